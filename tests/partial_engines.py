"""Test engines written against `generate` made PartialEngines (rollout/engine.py): submit queues the groups,
the first poll generates every queued group in one `generate` call and returns them, stop returns what is still
queued as stopped samples with no tokens."""

import dataclasses

from rollout.engine import Completion


class SubmitPollStop:
    def submit(self, groups, params):
        self.queued = getattr(self, "queued", []) + list(groups)
        self.params = params

    def poll(self):
        queued, self.queued = getattr(self, "queued", []), []
        if not queued:
            return []
        out = self.generate([g.prompt_ids for g in queued], self.params)
        return [dataclasses.replace(c, prompt_index=queued[c.prompt_index].key) for c in out]

    def stop(self):
        queued, self.queued = getattr(self, "queued", []), []
        return [Completion(g.key, s, [], [], "abort") for g in queued for s in range(self.params.n)]
