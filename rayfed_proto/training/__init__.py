"""Training code shared by the methods' local updates beyond one client's own loop (which is
``ClientAlgorithm.local_train`` in ``algorithms/base.py``): ``batched.py`` steps clients of one
architecture as one stacked, vmapped model. Plain PyTorch: no Ray, no method named."""
