"""Benchmark suite: the project's training against plain PyTorch doing the same work.

    make bench                                   # quick settings, a few minutes on 2 cores
    python -m scripts.bench --suite throughput,startup --rounds 3
    python -m scripts.bench --full               # 10-epoch accuracy, full epochs, more rounds

Results (Markdown table, JSON, PNG plots) go to ``bench_results/<timestamp>/``.
"""
