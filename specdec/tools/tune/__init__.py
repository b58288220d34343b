"""`specdec tune`: pick and tune a drafter on the user's prompts (cli.py), by the checklist's rule
(decide.py), from measurements within a budget (measure.py, candidates.py), written as a config and a
report (report.py)."""
