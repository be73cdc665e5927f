"""The suffix drafter (suffix decoding, after Snowflake's Arctic Inference, vLLM's `suffix` method): a suffix tree
over each request's own context, and one over the recent outputs of the request's tenant, matched against the
context's end; the longest match proposes the continuation seen most often after it.

`SuffixTree` is a suffix trie cut at `depth`: every substring of at most `depth` tokens of the sequences added is
a path from the root, each node counting the substring's occurrences. Appending a token costs O(depth) (the nodes
of the suffixes ending at the previous token are extended: Ukkonen's online construction without compression,
which the depth bound makes affordable), taking the last token back O(depth^2), the longest match of a query
O(depth log depth) (a binary search on the match length: every suffix of a substring is a substring).

Cross-request drafting remembers text across requests, so it is scoped: a request's output joins the tree of its
tenant (the API key it came with, `DrafterCall.tenant`) when it is released, and only that tenant's requests are
matched against that tree. A request without a tenant neither reads nor feeds one. Per tenant the tree holds the
last `cached_outputs` outputs (the oldest taken back out), and the `max_tenants` most recently served tenants
keep theirs."""

from __future__ import annotations

from collections import OrderedDict, deque

from engines.model_free import LookupState, Match, ModelFreeDrafter


class _Node:
    __slots__ = ("children", "count", "first")

    def __init__(self, first: int):
        self.count = 0  # occurrences of the substring this node spells
        self.first = first  # the tree's clock when it first occurred (ties go to the continuation seen first)
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """The suffix trie of some token sequences, cut at `depth` tokens."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix tree depth {depth}: need at least 2")
        self.depth = depth
        self.root = _Node(0)
        self.clock = 0

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append `token` to a sequence whose suffixes of 1..depth-1 tokens end at `active` (shortest first, [] at
        its start); the new sequence's such nodes."""
        self.clock += 1
        new = []
        for node in (self.root, *active):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(self.clock)
            child.count += 1
            new.append(child)
        if len(new) == self.depth:  # the longest suffix reached the depth: it is not extended again
            new.pop()
        return new

    def active(self, tail: list[int]) -> list[_Node]:
        """The nodes of `tail`'s suffixes of 1..depth-1 tokens (`tail`: a sequence's end, all of it added)."""
        return [self._walk(tail[len(tail) - n:]) for n in range(1, min(len(tail), self.depth - 1) + 1)]

    def retract(self, tail: list[int]) -> None:
        """Take back the last token of a sequence whose end is `tail` (its last `depth` tokens at least, or all of
        it), added last: one occurrence less of each of its suffixes."""
        for n in range(1, min(len(tail), self.depth) + 1):
            parent = self._walk(tail[len(tail) - n:-1])
            node = parent.children[tail[-1]]
            node.count -= 1
            if node.count == 0:
                del parent.children[tail[-1]]

    def add(self, seq: list[int]) -> None:
        active: list[_Node] = []
        for t in seq:
            active = self.extend(active, t)

    def remove(self, seq: list[int]) -> None:
        """Take a sequence added before back out: one occurrence less of each of its substrings."""
        for i in range(len(seq)):
            node = self.root
            for t in seq[i:i + self.depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    del node.children[t]  # its subtree counted only this occurrence
                    break
                node = child

    def _walk(self, path: list[int]) -> _Node | None:
        node = self.root
        for t in path:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def match(self, query: list[int]) -> Match | None:
        """The longest suffix of `query` (at most depth - 1 tokens) that occurred with a continuation: its length
        and the continuations' counts; None if not even its last token did."""
        lo, hi, best = 1, min(len(query), self.depth - 1), None
        while lo <= hi:
            n = (lo + hi) // 2
            node = self._walk(query[len(query) - n:])
            if node is not None and node.children:
                best, lo = (n, node), n + 1
            else:
                hi = n - 1
        if best is None:
            return None
        n, node = best
        return Match(n, {t: (c.count, c.first) for t, c in node.children.items()})


class SuffixDrafterEngine(ModelFreeDrafter):
    def __init__(self, name: str, max_depth: int = 24, cross_request: bool = True, cached_outputs: int = 64,
                 max_tenants: int = 256, max_requests: int = 64, max_len: int = 2048, min_prob: float = 0.1):
        super().__init__(name, max_requests, max_len, min_prob)
        self.window = self.depth = max_depth
        SuffixTree(max_depth)  # refuses a depth it cannot index
        self.cross_request, self.cached_outputs, self.max_tenants = cross_request, cached_outputs, max_tenants
        self.tenants: OrderedDict[str, tuple[SuffixTree, deque]] = OrderedDict()  # tenant -> tree, its outputs

    def _new_index(self, state: LookupState):
        state.active = []
        return SuffixTree(self.depth)

    def _append(self, rid: str, token: int) -> None:
        st = self.states[rid]
        st.active = st.index.extend(st.active, token)

    def _pop(self, rid: str) -> None:
        st = self.states[rid]
        st.index.retract(st.tokens[-self.depth:])
        st.active = st.index.active(st.tokens[-self.depth:-1])

    def _match(self, rid: str, query: list[int]) -> Match | None:
        st = self.states[rid]
        own = st.index.match(query)
        shared = self.tenants.get(st.tenant) if self.cross_request and st.tenant is not None else None
        other = shared[0].match(query) if shared is not None else None
        if own is None or (other is not None and other.length > own.length):
            return other
        return own

    def forget_outputs(self) -> int:
        """Forget every tenant's outputs (a benchmark's repeats each start from an empty tree); how many there were."""
        n = sum(len(outputs) for _, outputs in self.tenants.values())
        self.tenants.clear()
        return n

    def _forget(self, rid: str) -> None:
        st = self.states[rid]
        output = st.tokens[st.prompt_len:]
        if not (self.cross_request and st.tenant is not None and output):
            return
        if st.tenant not in self.tenants:
            self.tenants[st.tenant] = (SuffixTree(self.depth), deque())
        self.tenants.move_to_end(st.tenant)
        tree, outputs = self.tenants[st.tenant]
        tree.add(output)
        outputs.append(output)
        if len(outputs) > self.cached_outputs:
            tree.remove(outputs.popleft())
        while len(self.tenants) > self.max_tenants:
            self.tenants.popitem(last=False)
