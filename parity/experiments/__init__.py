"""The seeds' reproduction as an application of the library: sweeps, claims and their verdicts."""
