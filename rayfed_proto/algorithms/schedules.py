"""The alignment curriculum (FedSAP Eq. 7 and appendix A.1-A.2) as a component any method uses.

lambda_t = lambda * g((t - start) / length), with g clipped to [0, 1], where t is the server
version the client trained against. ``lambda`` is the method's own alignment weight (FedSAP's
M); the schedule only shapes when it arrives. Without a schedule a method keeps its paper's
constant weight (ALGORITHMS.md, **Decision**: a generic component, not FedSAP's private code).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field

from rayfed_proto.numbers import StrictNumbers


class AlignmentSchedule(StrictNumbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    shape: Literal["linear", "cosine", "sigmoid", "step"] = Field(
        "linear", description="ramp shape g: linear (FedSAP Eq. 7), cosine, sigmoid, or step")
    start: int = Field(20, ge=0, description="r_start: the version where the ramp begins (0 before)")
    length: int = Field(80, ge=1, description="t_w: versions from start to the full weight")

    def factor(self, version: int) -> float:
        """g in [0, 1] at ``version``."""
        u = min(max((version - self.start) / self.length, 0.0), 1.0)
        if self.shape == "linear":
            return u  # FedSAP Eq. 7: min(t / t_w, 1), shifted to begin at r_start
        if self.shape == "cosine":
            return 0.5 * (1.0 - math.cos(math.pi * u))
        if self.shape == "sigmoid":
            # logistic centred mid-ramp, rescaled so that g(0) = 0 and g(1) = 1 exactly
            lo, hi = 1 / (1 + math.exp(5.0)), 1 / (1 + math.exp(-5.0))
            return (1 / (1 + math.exp(-10.0 * (u - 0.5))) - lo) / (hi - lo)
        # step (Decision): nothing until the ramp's end, then the full weight at once
        return 1.0 if u >= 1.0 else 0.0
