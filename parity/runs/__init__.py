"""What a training run needs besides its loop (parity/trainer.py).

    dirs.py          run directories: the lock every writing command takes, metrics.jsonl's reader
    model.py         the run's policy, tokenizer and task, as its config names them
    sources.py       where each step's rollout comes from (the engine in process, or async)
    checkpoints.py   checkpoints that survive crashes, and resuming from them
    distributed.py   one process per rank on torch.distributed
    memory.py        what a run needs in memory, said before it starts
    step_metrics.py  a step's metrics from what each rank saw
    finite.py        what happens to a NaN: an update skipped and counted, a log-prob left out
                     (a positive one too: logits in its place)
    loggers.py       TensorBoard and Weights & Biases beside metrics.jsonl
"""
