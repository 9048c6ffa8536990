"""`StateHandle`: what a prefill instance returns for one request (docs/design.md §2 step 2)."""
from __future__ import annotations

import msgspec

from pdserve.model.sampling import SamplingParams, TokenLogprob
from pdserve.state.manifest import StateManifest
from pdserve.transfer.nixl_agent import AgentInfo


class StateHandle(msgspec.Struct, frozen=True):
    request_id: str
    instance: str
    generation: int
    agents: list[AgentInfo]      # per source rank
    manifest: StateManifest
    first_token: int
    params: SamplingParams       # with the concrete seed the first token was sampled with
    prompt_tokens: int
    lease_deadline: float        # wall clock (time.time()) when the source frees the state
    finished: str | None = None  # "stop" / "length" when the first token already ends it
    first_logprob: TokenLogprob | None = None  # with params.logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs
