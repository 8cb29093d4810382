#!/bin/bash
# usage: run.sh TREE TAG
cd $1
PY=/work/main/.venv/bin/python
export PYTHONPATH=$PWD
COMMON="--datasets digits synthetic --seeds 0 1 --rounds 6 --eval-every 3 --clients 6 --clients-per-actor 3"
$PY bench/compare_methods.py --methods fedproto fedtgp fedsa fedsap fedprotokd $COMMON --tracking-uri sqlite:////tmp/cmp/$2.db --out /tmp/cmp/$2_hetero
$PY bench/compare_methods.py --methods fedavg fedlsa fedsc $COMMON --set model.group=HtFE1 --tracking-uri sqlite:////tmp/cmp/$2.db --out /tmp/cmp/$2_homo
echo DONE
