"""Reports: tables and matplotlib figures, built from frames only."""
