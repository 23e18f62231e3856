"""Turn finished runs into the strategy table and the paper's figures.

`python -m analysis RUN_DIRS... --out DIR` (see `analysis/__main__.py`). The pieces:
`analysis.runs` (find, read, check and label runs), `analysis.table` (the strategy table in
Markdown, CSV and LaTeX), `analysis.figures` (PNG figures, PDF on request), `analysis.section` (the results
section a docs page includes: pass@1 on both evaluation splits, the diagnostics, the best AQN
setting), `analysis.determinism` (two runs of one config and seed, step by step), `analysis.stats`
(the across-seed t-interval).
"""
