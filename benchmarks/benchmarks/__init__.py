"""asv benchmarks for odtrain: training step time, peak memory, arena size and cold start."""
