"""One step of the scheduler: its plan's forward over the model and each sequence's
result handed to its job.

Apart from scheduler.py (the thread's loop, admission, composition, retirement) because
this is the part that knows how a step meets the model: which expert set each sequence
runs with, and how a failing forward is attributed to the one sequence that caused it.

A step is one Model.forward whatever the expert sets of its sequences (a pinned snapshot,
a canary's set, the live one): each sequence carries its own, and the pipeline routes it
and runs its experts through that set's table (forward/mixedsets.py).
"""
from __future__ import annotations


def run_step(sched, plan: list) -> None:
    """Run one step's plan [(job, tokens, all logits)] and hand each job its result,
    in the step's order (a failure fails that job's request only)."""
    model = sched.engine.model
    current = model.expert_set
    sets = [j.es if j.pin else current for j, _, _ in plan]
    # the forward sees each set's sequences side by side (one router call per run of one
    # set and layer); the results go back to the step's order
    first: dict = {}
    order = sorted(range(len(plan)), key=lambda i: first.setdefault(id(sets[i]), i))
    got = forward_items(model, [plan[i] for i in order], [sets[i] for i in order])
    outs: list = [None] * len(plan)
    for i, o in zip(order, got):
        outs[i] = o
    if sched.prefix is not None:
        sched.prefix.note(plan, outs, sets)
    if sched.trace is not None:
        sched.trace.append([(j.request.id, len(t), sets[i].generation)
                            for i, (j, t, _) in enumerate(plan)])
    for (j, toks, _), out, es in zip(plan, outs, sets):     # the step's order
        req = j.request
        if req.error is not None:
            continue
        if isinstance(out, BaseException):
            sched._fail(req, out)
            continue
        if j.fed < len(j.tokens):
            j.fed += len(toks)
        else:
            j.feed = None
        try:
            j.after_step(out, es, j.fed >= len(j.tokens))
        except Exception as exc:             # noqa: BLE001 - this request only
            sched._fail(req, exc)


def forward_items(model, items: list, sets: list) -> list:
    """One Model.forward over the items (job, tokens, all their logits or the last
    token's), each with its expert set (`sets`, one per item); when it fails, each item
    alone (its result or its error), so that a fault one sequence causes fails only that
    one."""
    jobs = [j for j, _, _ in items]
    lengths = [j.cache.length for j in jobs]
    try:
        return model.forward([t for _, t, _ in items], [j.cache for j in jobs],
                             [j.k for j in jobs], all_logits=[a for _, _, a in items],
                             expert_set=sets)
    except Exception as exc:                 # noqa: BLE001 - attributed below
        if len(items) == 1:
            return [exc]
    outs = []
    for (j, t, a), n, es in zip(items, lengths, sets):
        j.cache.length = n
        try:
            outs.append(model.forward([t], [j.cache], [j.k], all_logits=a,
                                      expert_set=es)[0])
        except Exception as exc:             # noqa: BLE001 - this sequence's
            j.cache.length = n
            outs.append(exc)
    return outs
