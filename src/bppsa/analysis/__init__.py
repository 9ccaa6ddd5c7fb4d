"""From the measured CSVs to what they say: speedups with intervals, the paper's numbers, the claims table, the
report.  Reads the results tree; imports the core modules, never the other way round."""
