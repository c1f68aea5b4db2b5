"""``python -m benchmarks``: ours against PyTorch side by side (``benchmarks/side_by_side.py``)."""

from benchmarks.side_by_side import main

main()
