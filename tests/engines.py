"""Test helpers for the engine protocol (rollout/engine.py): `generate` drives an engine as train.py does,
through the guard (run/guard.py GuardedEngine: submit, then polls until every completion is back), and
`ByGenerate` makes an engine written against a `generate(prompts, params)` method one: submit keeps the
prompts, the first poll answers them all."""

from rollout.engine import Polled
from run.guard import GuardedEngine


def generate(engine, prompts, params, dist_env=None, **options):
    """engine's completions of `prompts`, grouped by prompt, as GuardedEngine.generate returns them."""
    return GuardedEngine(engine, dist_env, **options).generate(prompts, params)


class ByGenerate:
    def submit(self, prompts, params):
        self.queued, self.params = list(prompts), params

    def poll(self):
        queued, self.queued = getattr(self, "queued", []), []
        if not queued:
            return Polled([], 0, True)
        out = self.generate(queued, self.params)
        return Polled(out, sum(len(c.token_ids) for c in out), True)
