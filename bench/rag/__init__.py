"""`kvrag bench`: every method on the same questions in one run, speed and quality side by side.

    metrics.py    answer normalisation, F1 / exact match, first-token KL, percentiles, summaries
    methods.py    the methods (full, prefix, reuse, blend@ratio, blend@auto) parsed from the options
    items.py      benchmark items: a MuSiQue-format file (each item with its passages) or questions
    datasets.py   the named sets (musique, cross-passage, sample) and their tuning / report splits
    cross_passage.py  a generated two-hop set: invented short passages, k = 2..10, look-alike distractors
    cross_passage_text.py  its invented names and sentence templates
    runner.py     setup (every chunk's KV stored before timing), warm-up, methods interleaved per item
    workloads.py  Poisson arrivals over measured service times
    cache_sim.py  memory-tier hit rates: the bench's passages replayed through the tiers (bench/replay.py)
    report.py     the report: per-method summaries, JSON, Markdown, rich tables
    plots.py      PNG figures with matplotlib's Agg backend

Nothing here prints: progress goes through callbacks, and the CLI (`kvrag.cli.bench_cmd`) shows it.
"""
