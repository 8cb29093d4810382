"""``rayfed-proto reproduce``: a paper's table run as its authors ran it, our numbers beside theirs.

``published``: the papers' numbers; ``settings``: what each table runs (presets and overrides per
scale); ``runner``: the plan, the runs, the table. See docs/reproduce.md.
"""

from rayfed_proto.reproduce.runner import available, execute, find, make_plan

__all__ = ["available", "execute", "find", "make_plan"]
