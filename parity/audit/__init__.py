"""`parity audit`: how much of a model's clipping is numerical, measured offline.

    command.py    the audit itself: sample (or read) completions, score them, write what it found
    measurement.py  what it accumulates over the batches: α/β, clip attribution, KLs, columns
    inputs.py     what it reads: another system's completions and log-probs, prompt files
    responses.py  saved answers of a serving engine (vLLM, SGLang, OpenAI-style) as audit input
    server.py     `--server URL`: the prompts sampled by a running server, then audited
    scale.py      `--scale`: the audit over the testbed's size ladder, fitted against size
    locate.py     `--locate`: the trainer against itself, and the gap located op by op
    advice.py     what the figures mean and what to do about them
"""
