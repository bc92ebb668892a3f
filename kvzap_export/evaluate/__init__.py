"""Does pruning hurt? Quality vs compression for KVzap and two baselines at equal compression."""
