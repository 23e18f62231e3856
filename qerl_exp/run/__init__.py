"""A run on disk and across processes: its directory and record (`rundir`, `record`, `run_files`),
checkpoints, metrics and W&B (`tracking`), whole files (`files`), the console and its notices
(`console`, `logs`, `progress`), stop requests (`signals`), the hub check (`hub`) and data-parallel
ranks (`distributed`).

Reads config/ only; nothing here knows how a step is computed.
"""
