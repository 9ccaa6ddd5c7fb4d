"""One function per figure; each reads only the measured CSVs."""
