"""The stall-free scheduler (Sarathi-Serve) and the two old behaviours it replaces.

Each iteration, in ``stall_free`` mode, four passes fill one token budget
(``_schedule``, and the methods in that order below it):

1. every running decode gets its token(s), highest priority then oldest
   first; a decode that needs a KV block when none is free preempts the
   lowest-priority, newest decode (recompute);
2. partially prefilled prompts get their next chunk, oldest first;
3. waiting prompts are admitted in policy order while budget, ``max_num_seqs``
   and KV room (the prompt's final footprint) remain; a prompt that does not
   fit contributes a chunk and carries over;
4. with ``speculate``, decodes whose context proposes draft tokens get them
   from what the budget (and the TBT target) still leaves, where the cost
   model says they pay (``_draft``).

A chunk is an even share of the iterations its prompt needs at what the budget
leaves (``chunk_rule.even_share`` says why).

In ``stall_free`` mode passes 2 and 3 run for short prompts first, then for long ones (more than
``long_prefill_tokens`` still to prefill; by default more than one iteration
can take: the budget, or what fits a TBT target): a short prompt arriving
behind a long one is admitted in the next iteration instead of after the
long one's whole prefill, while a quarter of the leftover budget stays with
the long one.

With a TBT target (``tbt_slo_ms``) and decodes in the batch, every chunk is
also cut (``core.sched.time_limit``) to the most tokens whose predicted iteration time (the cost model,
over the decodes and the chunks placed so far) stays within the target;
short prompts may use three quarters of the time the decodes leave while a
long one waits. When the decodes alone fill the target, prefill still moves
at ``prefill_floor`` tokens (at least a quarter of them to the long prompt),
and the batch says why it may run over (``Batch.over_target``). While the
TTFT targets press (a queued prompt would miss its target at the pace the
TBT target allows, or has), ``tbt_stretch`` x the target stands for it. Chunks are
sized to ``aim`` x the target: 1 over the 99.9th percentile of the gap
decodes got (an iteration's end to the previous one's) over its predicted
time, in the last 256 iterations whose prefill was sized to a target (not
decode-only ones: ``core.sched.aim``), each counted once per decode in it.
The SLO's P99 is over tokens: one slow iteration with 30 decodes puts 30 gaps
in the tail, and a few hundred iterations' P99 is set by their one or two
worst crowded ones, so the aim covers those, not the 99th.

With TTFT targets and a ``ttft_reserve``, while every queued prompt has a
target it can still make, the prefill passes take only the tokens that
finish each prompt, nearest deadline first, by its deadline less that share
of its target (``core.sched.deadline.tokens_needed``, at least the floor):
iterations run below the TBT target while the queue has slack, and grow back
to it as deadlines near (SLOs-Serve sizes chunks under both SLOs this way).

With ``dynamic_chunking`` every iteration, the decodes and all its chunks, is
also kept within the predicted time of a budget-sized chunk with no prefix
(the level), with the same shares and floor, so the growing cost of attention
over a long prefix does not stretch the gap the budget was chosen for.

Pure Python: it decides, the runner computes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

from stallfree.core import faults
from stallfree.core.sched.aim import Aim
from stallfree.core.sched.append import append
from stallfree.core.sched.batch import Batch, Item, NewToken, Sampled
from stallfree.core.sched.block_manager import Admitted, BlockManager
from stallfree.core.sched.chunk_rule import BUDGET, WHOLE, ChunkRule
from stallfree.core.sched.config import Chunking, Policy, SchedulerConfig, Speculate
from stallfree.core.sched.cost import IterationCost
from stallfree.core.sched.deadline import Forecast, Pace, deadline_ns, late_together, slack_s, tokens_needed
from stallfree.core.sched.drafts import Drafter, NgramDrafter, expected_accepted, paying_drafts
from stallfree.core.sched.fairness import TenantCounters
from stallfree.core.sched.forecast import forecast_entry
from stallfree.core.sched.handoff import KvImport
from stallfree.core.sched.policy import class_rank, deadline_order, order_waiting, overdue_before
from stallfree.core.sched.request import Chunk, FinishReason, Request, RequestStatus
from stallfree.core.sched.stalls import PrefillLog
from stallfree.core.sched.time_limit import TimeLimit
from stallfree.core.sched.waiting import WaitingQueue

SHORT_SHARE = 0.75  # of the leftover budget (or target time) short prompts may use while a long one waits


class ScheduleFailed(RuntimeError):
    """schedule() raised; ``batch`` holds the items it had formed (its cause is chained)."""

    def __init__(self, batch: Batch) -> None:
        super().__init__(f"scheduling iteration {batch.iteration} failed")
        self.batch = batch


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: BlockManager,
        eos_token_ids: frozenset[int] = frozenset(),
        cost: IterationCost | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.cost = cost  # predicts iteration times: the TBT target, dynamic chunking and drafts need it
        self.drafter = drafter or NgramDrafter()
        self.aim = Aim()  # what fraction of the TBT target iterations are sized to
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admission order, oldest first
        self.requests: dict[str, Request] = {}
        self._queued_with_targets = 0  # requests waiting or prefilling that have a TTFT target
        self.num_preemptions = 0
        self.num_added = 0  # requests ever given (the gateway counts those it sent since a forecast)
        self.pace: Pace | None = None  # the prefill pace of the latest iteration with deadlines to keep
        self._late: frozenset[str] = frozenset()  # this iteration's prompts relegated together (_late_together)
        self.tenants = TenantCounters()  # tokens served per tenant: the fair policy's order
        self._iteration = 0
        self._finished: list[str] = []  # requests ended since the last batch: the next one names them
        self._prefills = PrefillLog()  # who recent iterations chunked: stall attribution

    # -- queue -------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.num_added += 1
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.imported_tokens and req.imported_tokens != req.num_tokens - 1:
            raise ValueError("imported KV must cover every token but the last")
        self.tenants.join(req.tenant)
        if req.ttft_slo_ms is None:
            req.ttft_slo_ms = self.config.ttft_slo_ms
        req.tbt_slo_ms = self.config.tbt_slo_ms
        self.requests[req.request_id] = req
        self._queued_with_targets += bool(req.ttft_slo_ms) and queued(req.status)
        self.waiting.add(req)

    def abort(self, request_id: str, now_ns: int) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, FinishReason.ABORT, now_ns)
        return req

    def finish(self, req: Request, reason: FinishReason, now_ns: int) -> None:
        """End req: free its KV at once and drop it from the queues. Also
        sound after a failed iteration left req half-way between states."""
        self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)
        self._set_status(req, RequestStatus.FINISHED)
        req.finish_reason = reason
        req.timeline.finished_ns = now_ns
        if self.requests.pop(req.request_id, None) is not None:
            self._finished.append(req.request_id)
            self.tenants.leave(req.tenant)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def num_partial_prefills(self) -> int:
        return sum(1 for r in self.running if r.status == RequestStatus.PREFILLING)

    def forecast(self, now_ns: int) -> Forecast | None:
        """What admission reads, at the latest pace (None before one is known):
        each queued prompt's place in the order (``core.sched.deadline.Place``)
        and the prefill it still needs. Prompts with no target and those past
        the starvation ceiling stand behind every prompt with a target (due at
        infinity). Left out: prompts that can no longer meet their targets
        (they go after any newcomer) unless past the starvation ceiling, and
        the other choices of a prompt still computing;
        the choices of a prompt already computed count one token each (they
        take its blocks, not a prefill of their own). The waiting prompts'
        places are kept by the queue as time passes them (``core.sched.forecast``);
        partial prefills and sibling choices are read one by one."""
        pace = self.pace
        if pace is None:
            return None
        cfg = self.config
        policy, served_now = cfg.policy, self.tenants.served
        cutoff = overdue_before(now_ns, cfg.max_defer_s)
        # the waiting prompts as the queue keeps them (their places change only as time passes them)
        queued = self.waiting.places.places(now_ns, pace, policy, cfg.max_defer_s, served_now)
        partials = (r for r in self.running if r.status == RequestStatus.PREFILLING)
        for r in itertools.chain(partials, self.waiting.places.siblings.values()):  # and, one by one, these
            sibling = r.prefill_after is not None
            if sibling and self._prompt_pending(r.prefill_after):
                continue
            # a choice whose sibling has computed the prompt takes its blocks: one token, not a prefill
            tokens = 1 if sibling and self._prompt_source(r) is not None else r.num_pending_tokens
            entry = forecast_entry(r, now_ns, pace, cutoff, policy, served_now, tokens)
            if entry is not None:
                queued.append(entry)
        served = self.tenants.active() if cfg.policy == Policy.FAIR else {}
        return Forecast.of(pace, self.num_added, queued, served)

    # -- schedule ----------------------------------------------------------
    def schedule(self, now_ns: int) -> Batch:
        """The next iteration's batch. If anything raises, ``ScheduleFailed``
        carries the batch as far as it got (the requests it touched)."""
        self._iteration += 1
        batch = Batch(self._iteration, finished=self._finished)
        self._finished = []
        self.drafter.release(batch.finished)
        try:
            faults.point("schedule")
            self._schedule(batch, now_ns)
            if self.cost is not None:
                batch.predicted_s = self.cost.iteration_s(*batch.shape())
        except Exception as exc:
            raise ScheduleFailed(batch) from exc
        return batch

    def _schedule(self, batch: Batch, now_ns: int) -> None:
        """The passes in order; each places its items in batch and returns the budget left."""
        mode = self.config.chunking
        budget = self.config.token_budget
        if mode == Chunking.NONE:
            # frozen batch: whole prompts in an iteration of their own, with
            # vLLM V0's rule that the batch cap is at least the context length
            cap = max(budget, self.config.max_model_len)
            left = self._prefill_running(batch, cap, WHOLE, self._partials(now_ns))
            self._admit(batch, left, WHOLE, self._to_admit(now_ns))
            if not batch.items:
                self._draft(batch, self._decode(batch, budget), None)
            return
        left = self._decode(batch, budget)  # pass 1
        self._set_target(batch)
        limit = self._time_limit(batch)
        self._late = frozenset()
        if self.cost is not None and self._keeps_deadlines():
            self._set_pace(batch, left, limit)
            if self._pressed(batch, now_ns):
                batch.run_over("deadlines")
                limit = self._time_limit(batch, self.config.tbt_stretch)
                self._set_pace(batch, left, limit)
            self._late = self._late_together(now_ns)
        if mode == Chunking.STALL_FREE and self._keeps_deadlines():  # passes 2 and 3
            left = self._prefill_by_deadline(batch, left, now_ns, limit)
        elif mode == Chunking.STALL_FREE:
            left = self._prefill(batch, left, now_ns, limit)
        else:  # decode_first, as FasterTransformer had it: no new prompt while anybody decodes
            shared = limit.shared(batch, 1.0, self.config.prefill_floor) if limit else BUDGET
            left = self._prefill_running(batch, left, shared, self._partials(now_ns))
            if not any(r.status == RequestStatus.DECODING for r in self.running):
                left = self._admit(batch, left, shared, self._to_admit(now_ns))
        self._draft(batch, left, limit)  # pass 4

    def _set_target(self, batch: Batch) -> None:
        """Once its decodes are placed: record on the batch the TBT target it is sized
        to (while it holds decodes and a cost model predicts), and whether they alone fill it."""
        cfg, cost = self.config, self.cost
        if cost is None or not cfg.tbt_slo_ms or not batch.items:
            return
        batch.target_s = cfg.tbt_slo_ms / 1e3
        if cost.iteration_s(*batch.shape()) > batch.target_s:
            batch.run_over("decodes")

    def _time_limit(self, batch: Batch, stretch: float = 1.0) -> TimeLimit | None:
        """The limits on the iteration's time (None: none applies): dynamic chunking's
        level, and the batch's TBT target x the aim (x ``stretch`` while deadlines press)."""
        cfg, cost = self.config, self.cost
        if cost is None:
            return None
        level_s = cost.iteration_s([], [(0, cfg.token_budget)]) if cfg.dynamic_chunking else None
        target_s = batch.target_s * self.aim.value * stretch if batch.target_s else None
        return TimeLimit(cost, target_s, level_s) if target_s is not None or level_s is not None else None

    def _set_pace(self, batch: Batch, left: int, limit: TimeLimit | None) -> None:
        """The prefill pace of this iteration, which slack and admission's forecast read:
        the tokens one iteration takes of a prompt beside these decodes, and its time."""
        assert self.cost is not None
        tokens = self._iteration_tokens(batch, left, limit) if batch.target_s else max(1, left)
        self.pace = Pace(tokens, self.cost.iteration_s(batch.shape()[0], [(0, tokens)]))

    def _pressed(self, batch: Batch, now_ns: int) -> bool:
        """Whether this iteration stretches past its TBT target (``tbt_stretch``): the
        TTFT targets press, a queued prompt with one would miss it at this pace or
        has (a preempted decode has had its first token: no). Not when the decodes
        alone fill the target: the floor keeps prefill moving then. Partial
        prefills first, then the waiting oldest first: under a backlog the first
        few read say so."""
        if self.config.tbt_stretch <= 1.0 or not batch.target_s or batch.over_target is not None:
            return False
        pace = self.pace

        def late(r: Request) -> bool:
            return bool(r.ttft_slo_ms) and r.timeline.first_token_ns is None and slack_s(r, now_ns, pace) < 0

        partials = (r for r in self.running if r.status == RequestStatus.PREFILLING)
        return any(late(r) for r in itertools.chain(partials, self.waiting))

    def _decode(self, batch: Batch, left: int) -> int:
        """Pass 1: one token for every running decode, highest priority first;
        a decode that needs a KV block when none is free preempts the
        lowest-priority (then newest) decode. Served in that order, a victim
        is never one already served."""
        order = {id(r): i for i, r in enumerate(self.running)}

        def rank(r: Request) -> tuple[int, int]:
            return r.priority, order[id(r)]

        for req in sorted((r for r in self.running if r.status == RequestStatus.DECODING), key=rank):
            if req.status != RequestStatus.DECODING:
                continue  # preempted earlier in this loop
            if left == 0:
                break
            while not self._allocate(batch, req, 1):
                victim = max((r for r in self.running if r.status == RequestStatus.DECODING), key=rank)
                self._preempt(victim, batch.preempted)
                if victim is req:
                    break
            else:
                batch.items.append(Item(req, req.num_computed_tokens, 1, is_prefill=False))
                left -= 1
        return left

    def _prefill(self, batch: Batch, left: int, now_ns: int, limit: TimeLimit | None) -> int:
        """Passes 2 and 3, short prompts first: partial then new short prefills
        take the leftover budget before long ones, so a short prompt never
        waits for a long prompt's whole prefill; while a long prompt is
        prefilling (or waiting), a quarter of the leftover (budget, target
        time and floor alike) is kept for it, so it progresses every
        iteration. While a request waits past ``max_defer_s``, admission
        follows policy order (the starvation ceiling puts it first) after all
        partial prefills."""
        long_tokens = self.config.long_prefill_tokens or self._iteration_tokens(batch, left, limit)
        floor = self.config.prefill_floor

        def long(r: Request) -> bool:
            return r.num_tokens - r.num_computed_tokens > long_tokens

        def short(r: Request) -> bool:
            return not long(r)

        partials = self._partials(now_ns)  # running order: no deadlines here; the passes below add only short ones
        waits_long = self.waiting.most_pending_tokens() > long_tokens or any(map(long, partials))
        kept = min(left, max(1, left // 4)) if waits_long else 0
        long_floor = max(1, floor // 4) if waits_long else 0
        first = limit.shared(batch, SHORT_SHARE if waits_long else 1.0, floor - long_floor) if limit else BUDGET
        short_left = self._prefill_running(batch, left - kept, first, [r for r in partials if short(r)])
        oldest_ns = self.waiting.oldest_arrival_ns()
        overdue = oldest_ns is not None and oldest_ns < overdue_before(now_ns, self.config.max_defer_s)
        if not overdue:  # short prompts are admitted before long partials run
            ordered = self._to_admit(now_ns)
            short_left = self._admit(batch, short_left, first, [r for r in ordered if short(r)])
        rest = limit.shared(batch, 1.0, max(floor - batch.prefill_tokens, long_floor)) if limit else BUDGET
        left = self._prefill_running(batch, kept + short_left, rest, [r for r in partials if long(r)])
        return self._admit(batch, left, rest, self._to_admit(now_ns) if overdue else [r for r in ordered if long(r)])

    def _prefill_by_deadline(self, batch: Batch, left: int, now_ns: int, limit: TimeLimit | None) -> int:
        """Passes 2 and 3 under TTFT targets: the TBT target still sizes the
        prefill share, the targets decide who gets it. Partial prefills and
        waiting prompts are taken in one order, the nearest deadline first among
        those whose slack says they can still make it (``_by_deadline``), instead
        of short ones first: a short prompt goes ahead of a long one exactly
        when its deadline is the nearer. Once a waiting prompt cannot be
        admitted (KV room, the partial-prefill limit), no later one is.

        The partial-prefill limit follows the same order: a prompt that can
        still meet its target and finds every slot held takes the slot of the
        partial prefill last in the order after it (due later, or already
        late; never one of a more urgent priority), which goes back to waiting
        (``Batch.yielded``) with its computed blocks left in the prefix cache,
        to go on from them when its turn comes (unless they are evicted first). So another key's long prompts, due
        later or late, cannot keep it waiting for their slots; the starvation
        ceiling still bounds how long any prompt waits."""
        shared = limit.shared(batch, 1.0, self.config.prefill_floor) if limit else BUDGET
        slack = self._slack(now_ns)
        assert slack is not None
        admitting = True
        order = self._by_deadline(now_ns)
        held = left - self._deadline_tokens(batch, order, slack, now_ns, left)
        left -= held
        runs = [(p, list(g)) for p, g in itertools.groupby(order, key=lambda r: r.status == RequestStatus.PREFILLING)]
        for i, (partial, run) in enumerate(runs):
            if left == 0:
                break
            if partial:  # in pass 2's order (``_partials``), not the run's
                chosen = set(run)
                left = self._prefill_running(batch, left, shared, [r for r in self._partials(now_ns) if r in chosen])
            elif admitting:
                later = [r for is_partial, rs in runs[i + 1 :] if is_partial for r in rs]

                def room_for(req: Request, later: list[Request] = later) -> Request | None:
                    """The partial prefill to yield its slot to req: the last after req still
                    prefilling, none more urgent in priority (None: req may not take one)."""
                    yielding = [r for r in later if r.priority >= req.priority and r.status == RequestStatus.PREFILLING]
                    return yielding[-1] if yielding and slack(req) >= 0 else None

                left = self._admit(batch, left, shared, run, room_for=room_for)
                admitting = run[-1].status != RequestStatus.WAITING
        return left + held

    def _deadline_tokens(
        self, batch: Batch, order: list[Request], slack: Callable[[Request], float], now_ns: int, left: int
    ) -> int:
        """With ``ttft_reserve``: the prefill tokens this iteration needs for every
        prompt in ``order`` to finish by its deadline less its reserve; ``left``
        (no cap) while a prompt has no target or cannot make it, or without a cost model."""
        reserve = self.config.ttft_reserve
        if not reserve or self.cost is None or not order or left <= 0:
            return left
        windows, through = [], 0
        for req in order:
            due = deadline_ns(req)
            if due is None or req.ttft_slo_ms is None or slack(req) < 0:
                return left
            through += req.num_pending_tokens
            windows.append((through, (due - now_ns) / 1e9 - reserve * req.ttft_slo_ms / 1e3))
        decodes = batch.shape()[0]
        cost = self.cost
        needed = tokens_needed(windows, lambda n: cost.iteration_s(decodes, [(0, n)]), self.config.prefill_floor, left)
        return min(left, needed)

    def _by_deadline(self, now_ns: int) -> list[Request]:
        """Partial prefills and waiting prompts merged into one order, each list
        keeping its own (the waiting one's policy classes first): at each step
        the head first in ``deadline_order``, except that whatever has waited
        past the starvation ceiling (``max_defer_s``), partial or waiting, goes
        before everything else, oldest first."""
        slack = self._slack(now_ns)
        assert slack is not None
        cutoff = overdue_before(now_ns, self.config.max_defer_s)

        def key(r: Request) -> tuple[float, ...]:
            return deadline_order(r, slack, cutoff)

        partials, waiting = sorted(self._partials(now_ns), key=key), self._to_admit(now_ns)
        merged: list[Request] = []
        i = j = 0
        while i < len(partials) or j < len(waiting):
            if j < len(waiting) and (i == len(partials) or key(waiting[j]) < key(partials[i])):
                merged.append(waiting[j])
                j += 1
            else:
                merged.append(partials[i])
                i += 1
        return merged

    def _iteration_tokens(self, batch: Batch, left: int, limit: TimeLimit | None) -> int:
        """What one iteration can take of a prompt, the measure of a long one: the
        token budget, or under a TBT target the tokens whose time fits it beside
        the decodes (at least the floor)."""
        if limit is None or limit.target_s is None:
            return self.config.token_budget
        return max(limit.fit(batch, 0, left, limit.target_s), self.config.prefill_floor)

    def _prefill_running(self, batch: Batch, left: int, rule: ChunkRule, partials: list[Request]) -> int:
        """Pass 2: the next chunk of each of ``partials`` (partly prefilled prompts), in that order."""
        for req in partials:
            if left == 0:
                break
            n, over = rule.chunk(batch, req.num_computed_tokens, req.num_pending_tokens, left)
            if over:
                batch.run_over("floor")
            if n == 0:
                continue
            if not self._allocate(batch, req, n):  # admission reserved the whole prompt
                raise RuntimeError(f"KV reservation of {req.request_id} was not honoured")
            batch.items.append(Item(req, req.num_computed_tokens, n, is_prefill=True))
            left -= n
        return left

    def _admit(
        self,
        batch: Batch,
        left: int,
        rule: ChunkRule,
        ordered: list[Request],
        room_for: Callable[[Request], Request | None] | None = None,
    ) -> int:
        """Pass 3: admit from ``ordered`` (waiting requests in policy order).
        ``room_for(req)``: the partial prefill that yields its slot to req when
        all are held (None: none may); it yields only once req is admitted."""
        cfg = self.config
        if not ordered or left == 0:
            return left
        finishing = {item.request for item in batch.items if item.is_prefill and item.samples}
        partial = sum(1 for r in self.running if r.status == RequestStatus.PREFILLING and r not in finishing)
        admitted = []
        for req in ordered:
            if left == 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if self._prompt_pending(req.prefill_after):
                continue
            if req.imported_tokens and not req.num_preemptions:
                if not self._admit_imported(batch, req):
                    break
                admitted.append(req)
                left -= 1
                continue
            head = self._prompt_source(req)
            pending = 1 if head is not None else req.num_tokens - self.kv.cached_prefix_tokens(req)
            n, over = rule.chunk(batch, req.num_tokens - pending, pending, left)
            if over:
                batch.run_over("floor")
            if n == 0:
                break
            yielding = None
            if n < pending and partial >= cfg.max_partial_prefills:
                yielding = room_for(req) if room_for is not None else None
                if yielding is None:
                    continue  # would stay partial; a prompt that finishes in this chunk may still go
            footprint = self._footprint(req)
            found = self.kv.share(req, head, footprint) if head is not None else self.kv.admit(req, footprint)
            if not self._admitted(req, found):
                break  # head of line waits for KV room rather than being overtaken forever
            if yielding is not None:  # only for a prompt admitted
                self._preempt(yielding, batch.yielded, first=True)
                partial -= 1
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            self._set_status(req, RequestStatus.PREFILLING)
            self.running.append(req)
            admitted.append(req)
            self._allocate(batch, req, n)  # within what admission reserved
            batch.items.append(Item(req, req.num_computed_tokens, n, is_prefill=True))
            left -= n
            partial += n < pending
        self.waiting.remove_all(admitted)
        return left

    def _footprint(self, req: Request) -> int:
        """Tokens of KV to guarantee req at admission: what it holds plus its decode reserve."""
        cfg = self.config
        reserve = min(req.sampling.max_tokens - req.num_output_tokens, cfg.decode_reserve_tokens)
        return min(req.num_tokens + reserve, cfg.max_model_len)

    def _admit_imported(self, batch: Batch, req: Request) -> bool:
        """A prompt prefilled elsewhere: its KV into fresh blocks, then straight to
        decoding, its last prompt token first (whose logits give the first token)."""
        if not self._admitted(req, self.kv.admit_imported(req, self._footprint(req))):
            return False
        self.kv.cache_computed(req)  # its full blocks join the prefix cache as computed ones do
        self._set_status(req, RequestStatus.DECODING)
        self.running.append(req)
        self._allocate(batch, req, 1)  # within what admission reserved
        handoff = req.handoff
        if handoff is not None and handoff.payload is not None:
            batch.imports.append(KvImport(list(req.block_ids), handoff.imported_tokens, handoff.payload))
            handoff.payload = None
        # among the decodes, ahead of this pass's chunks: the runner reads the first
        # num_decodes sequences as one query row each (Batch)
        lead = sum(1 for item in batch.items if not item.is_prefill)
        batch.items.insert(lead, Item(req, req.num_computed_tokens, 1, is_prefill=False))
        return True

    def _prompt_source(self, req: Request) -> Request | None:
        """The sibling choice whose computed prompt req can share, if it still holds it."""
        head = self.requests.get(req.prefill_after) if req.prefill_after is not None else None
        if head is None or req.num_output_tokens or head.num_computed_tokens < req.num_prompt_tokens:
            return None  # gone, or req was preempted after output: the prefix cache serves instead
        return head

    def _prompt_pending(self, request_id: str | None) -> bool:
        """Is that request (a sibling choice) still waiting for or computing its prompt?"""
        head = self.requests.get(request_id) if request_id is not None else None
        return head is not None and head.status in (RequestStatus.WAITING, RequestStatus.PREFILLING)

    def _draft(self, batch: Batch, left: int, limit: TimeLimit | None) -> None:
        """Pass 4, speculative decoding: draft tokens for decodes whose context
        proposes some, from what is left once every decode has its token and
        every prompt its chunk (the budget, and the TBT target's or dynamic
        chunking's time): drafts
        never displace a decode or shrink a chunk. Decodes are served in pass
        1's order. With a cost model a decode gets the most of its drafts that
        pay (``paying_drafts``): the tokens they are expected to add (its
        acceptance rate) per second they add to the iteration must beat the
        batch's tokens per second without them. Where extra rows cost nearly
        what tokens do (a CPU past a few rows) that turns speculation off as
        batches grow. Requests with penalties (their counts would need the
        drafts) or that opted out never speculate."""
        cfg = self.config
        if cfg.speculate == Speculate.OFF or left == 0:
            return
        cost = self.cost
        decodes, chunks = batch.shape()
        now_s = cost.iteration_s(decodes, chunks) if cost is not None else 0.0
        limit_s = limit.ceiling_s if limit is not None else math.inf
        yielded = float(sum(1 for item in batch.items if item.samples))  # expected tokens out of the batch
        speculating: dict[int, Item] = {}  # item index -> the item with drafts that replaces it
        for index, item in enumerate(batch.items):
            req, sp = item.request, item.request.sampling
            if item.is_prefill or not sp.speculate or sp.uses_history or left == 0:
                continue
            room = min(sp.max_tokens - req.num_output_tokens, cfg.max_model_len - req.num_tokens) - 1
            most = min(self.drafter.limit(req, cfg.draft_tokens), room, left)
            drafts = self.drafter.propose(req, most, (cfg.ngram_min, cfg.ngram_max)) if most > 0 else ()
            n = len(drafts)
            if cost is not None and n:
                acceptance = self.drafter.acceptance(req)
                n, then_s = paying_drafts(cost, (decodes, chunks), now_s, yielded, limit_s, item.start, n, acceptance)
                if n == 0:
                    batch.drafts_declined += 1
                    continue
                if not self._allocate(batch, req, 1 + n):  # drafts never preempt anybody
                    continue
                decodes += [item.start + 1 + i for i in range(n)]
                now_s, yielded = then_s, yielded + expected_accepted(acceptance, n)
            elif n == 0 or not self._allocate(batch, req, 1 + n):
                continue
            speculating[index] = Item(req, item.start, 1 + n, is_prefill=False, drafts=drafts[:n])
            left -= n
        if speculating:  # to the end, after the chunks: one-token decodes lead the batch (Batch)
            batch.items = [item for i, item in enumerate(batch.items) if i not in speculating]
            batch.items += speculating.values()

    def _allocate(self, batch: Batch, req: Request, num_new_tokens: int) -> bool:
        """Grow req's blocks for this batch (the copies it needs go with the batch), or change nothing."""
        grown = self.kv.allocate(req, num_new_tokens)
        if grown is None:
            return False
        batch.copies += grown.copies
        return True

    def _admitted(self, req: Request, admitted: Admitted | None) -> bool:
        """Record what admission found computed."""
        if admitted is None:
            return False
        req.num_computed_tokens = admitted.computed_tokens
        return True

    def _preempt(self, req: Request, into: list[Request], first: bool = False) -> None:
        """Recompute-style preemption: drop the KV (its computed blocks stay in the
        prefix cache until evicted), keep prompt and outputs; ``into``: the
        batch's list of such requests it belongs in; ``first``: ahead of the
        waiting prompts it ties with in policy order (they would evict its blocks)."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self._set_status(req, RequestStatus.WAITING)
        req.num_preemptions += 1
        self.num_preemptions += 1
        if first:
            self.waiting.add_first(req)
        else:
            self.waiting.add(req)
        into.append(req)

    def _to_admit(self, now_ns: int) -> list[Request]:
        """What admission reads: the waiting queue in policy order (in ``deadline_order``
        where prompts have TTFT targets), computed once per iteration; nothing while
        every seat is taken (``_admit`` would stop at once; with 10,000 waiting the
        sort alone cost an iteration 10-35 ms)."""
        if len(self.running) >= self.config.max_num_seqs:
            return []
        c = self.config
        slack = self._slack(now_ns)
        return order_waiting(
            list(self.waiting),
            c.policy,
            now_ns,
            c.max_defer_s,
            self.kv.cached_prefix_tokens,
            self.tenants.served,
            slack,
        )

    def _partials(self, now_ns: int) -> list[Request]:
        """Partly prefilled prompts, oldest first, or in ``deadline_order`` where they have TTFT targets."""
        partial = [r for r in self.running if r.status == RequestStatus.PREFILLING]
        slack = self._slack(now_ns)
        if slack is None:
            return partial
        cutoff = overdue_before(now_ns, self.config.max_defer_s)
        return sorted(partial, key=lambda r: deadline_order(r, slack, cutoff))

    def _keeps_deadlines(self) -> bool:
        """Has any queued prompt a TTFT target (the server's, or its own)?"""
        return bool(self.config.ttft_slo_ms) or self._queued_with_targets > 0

    def _set_status(self, req: Request, status: RequestStatus) -> None:
        """Every change of a known request's status goes through here, so the count
        of queued prompts with TTFT targets stays true without a scan."""
        if req.ttft_slo_ms and req.request_id in self.requests:
            self._queued_with_targets += queued(status) - queued(req.status)
        req.status = status

    def _slack(self, now_ns: int) -> Callable[[Request], float] | None:
        """Each prompt's slack at the pace of this iteration (None: no prompt has a
        TTFT target); minus infinity for one relegated with others (``_late_together``)."""
        if not self._keeps_deadlines():
            return None
        pace, late = self.pace, self._late
        return lambda r: -math.inf if r.request_id in late else slack_s(r, now_ns, pace)

    def _late_together(self, now_ns: int) -> frozenset[str]:
        """The prompts this iteration may prefill that could each make their TTFT
        targets alone but not together, relegated for this iteration
        (``core.sched.deadline.late_together``). The waiting ones only while a
        seat is free: with every seat taken none is admitted, and a flood of
        10,000 waiting is not read every iteration."""
        pace = self.pace
        assert pace is not None
        policy, served = self.config.policy, self.tenants.served
        partials = [r for r in self.running if r.status == RequestStatus.PREFILLING]
        seat = len(self.running) < self.config.max_num_seqs
        queued = [
            (class_rank(policy, r.priority, r.tenant, r.num_pending_tokens, served), r)
            for r in itertools.chain(partials, self.waiting if seat else ())
            if r.ttft_slo_ms and slack_s(r, now_ns, pace) >= 0
        ]
        return late_together(queued, now_ns, pace)

    # -- update ------------------------------------------------------------
    def update(self, batch: Batch, sampled: Sampled, start_ns: int, end_ns: int) -> list[NewToken]:
        """Advance every request in batch; sampled holds, per item that samples and
        in item order, the tokens it yielded (a speculating decode's kept drafts,
        then the token after them). Returns the tokens in that order; a request
        that ends keeps none drawn after its end."""
        faults.point("update")
        self.aim.learn(batch, start_ns, end_ns)
        self._prefills.record(batch)
        emitted: list[NewToken] = []
        for item, new, logprobs in sampled.per_item(batch.items):
            req = item.request
            if item.drafts:
                self._verified(item, len(new) - 1)
            self._record_times(item, batch.iteration, start_ns, end_ns)
            stalled = False
            if new:
                since, req.last_token_iteration = req.last_token_iteration, batch.iteration
                # a gap, stretched by another's prefill since req's previous token (the first token has no gap)
                stalled = req.timeline.first_token_ns is not None and self._prefills.overlapped(req.request_id, since)
            tokens, reason = append(req, new, logprobs, stalled, end_ns, self.eos_token_ids, self.config.max_model_len)
            if tokens:
                self._set_status(req, RequestStatus.DECODING)
            emitted += tokens
            computed = self._advance(item, len(tokens))
            self.tenants.serve(req.tenant, computed)
            self.kv.cache_computed(req, item.start)  # its full blocks join the prefix cache
            if reason is not None:
                self.finish(req, reason, end_ns)
            elif item.drafts:
                self.kv.trim(req, req.num_computed_tokens)  # the blocks that held only rejected drafts
        return emitted

    def _verified(self, item: Item, kept: int) -> None:
        """What a verification of the item's drafts kept (the runner's ``verified``)."""
        req = item.request
        req.num_draft_tokens += len(item.drafts)
        req.num_accepted_tokens += kept
        self.drafter.observe(req, len(item.drafts), kept)

    def _record_times(self, item: Item, iteration: int, start_ns: int, end_ns: int) -> None:
        """The request's timeline: when it was first scheduled, and each prefill chunk."""
        tl = item.request.timeline
        if tl.scheduled_ns is None:
            tl.scheduled_ns = start_ns
        if item.is_prefill:
            tl.chunks.append(Chunk(iteration, start_ns, end_ns, item.num_tokens, item.start))

    def _advance(self, item: Item, appended: int) -> int:
        """Advance the request past what the KV now holds, and return how much that is:
        the item's own tokens and, of its drafts, the kept ones: every token appended
        but the last, which no pass has fed yet. It reads only the item (a request
        has one per batch) and what was appended for it, so it holds wherever the
        item sits in the batch."""
        computed = item.num_tokens - len(item.drafts) + max(0, appended - 1)
        item.request.num_computed_tokens += computed
        return computed


def queued(status: RequestStatus) -> bool:
    """Waiting for admission (a preempted decode too) or prefilling."""
    return status in (RequestStatus.WAITING, RequestStatus.PREFILLING)
