"""ASV benchmark suite of Loki (asv.conf.json; docs/benchmarks.md).  Kernel speed needs CUDA and skips
elsewhere; accuracy runs on the CPU too."""
