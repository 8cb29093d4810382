"""Entry point of group ``rayfed_proto.datasets``: a dataset loader.

A loader is ``(cfg: DataConfig, seed: int) -> ArrayDataset`` with square images of side
``cfg.image_size``. This module is imported with ``rayfed_proto`` itself (config validation,
the CLI), so it imports only numpy at the top; heavy libraries belong inside the loader.
"""

import numpy as np

from rayfed_proto.data import DATASETS, ArrayDataset


@DATASETS.register("plugin_stripes", help="example plug-in: 64 noisy horizontal or vertical stripes, 2 classes")
def load_stripes(cfg, seed: int) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    n, size = 64, cfg.image_size
    labels = np.arange(n) % 2
    rows = (np.arange(size) // 2 % 2).astype(np.float32)  # 0, 0, 1, 1, 0, 0, ...
    horizontal = np.broadcast_to(rows[:, None], (size, size))
    images = np.where(labels[:, None, None] == 0, horizontal, horizontal.T)[:, None]
    images = np.clip(images + rng.normal(0, 0.1, images.shape), 0, 1).astype(np.float32)
    return ArrayDataset(name="plugin_stripes", images=images, labels=labels, num_classes=2,
                        class_names=["horizontal", "vertical"], client_ids=np.arange(n) % 4)
