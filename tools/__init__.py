"""Developer tools: tile sweeps, profiling and SASS helpers (the user benchmark is bench/)."""
