"""Reading compiled programs: FLOPs, HBM bytes and collectives from XLA's HLO, the host accounting of each dispatch's rounds, the bounds, the TPU chips' peaks and estimates."""
