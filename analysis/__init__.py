"""Turn finished runs into the strategy table and the paper's figures.

`python -m analysis RUN_DIRS... --out DIR` (see `analysis/__main__.py`). The pieces:
`analysis.runs` (find, read, check and label runs), `analysis.table` (the strategy table in
Markdown, CSV and LaTeX), `analysis.figures` (PNG and PDF figures), `analysis.stats` (the
across-seed t-interval).
"""
