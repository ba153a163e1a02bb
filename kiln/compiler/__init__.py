"""kiln's compiler: trace the backbone once, split it at attention, compile each unique piece."""
