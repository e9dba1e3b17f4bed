"""Test helpers for the engine protocol (rollout/engine.py): `generate` drives an engine as train.py does
on one process or several (rollout/engine.py generate, or through the guard: run/guard.py GuardedEngine), and
`ByGenerate` makes an engine written against a `generate(prompts, params)` method one: submit keeps the
prompts, the first poll answers them all."""

import rollout.engine
from rollout.engine import Polled
from run.guard import GuardedEngine


def generate(engine, prompts, params, dist_env=None):
    """engine's completions of `prompts`, grouped by prompt: on one process without the guard, on several through
    it (every rank polls until every rank's completions are back)."""
    if dist_env is None:
        return rollout.engine.generate(engine, prompts, params)
    return GuardedEngine(engine, dist_env).generate(prompts, params)


class ByGenerate:
    def submit(self, prompts, params):
        self.queued, self.params = list(prompts), params

    def poll(self):
        queued, self.queued = getattr(self, "queued", []), []
        if not queued:
            return Polled([], 0, True)
        out = self.generate(queued, self.params)
        return Polled(out, sum(len(c.token_ids) for c in out), True)
