"""The checkable statements of the hasse chapter's paper, and its paper claims.

See :mod:`companion.book.statements` for what a :class:`Statement` and a
:class:`PaperClaim` hold. The chapter records each claim by id; the tests in
`tests/test_falsifiers_hasse.py` apply each claim's falsifier.

The paper (arXiv 2606.09951, Li and Guo) is a theory paper with no experiments: its
abstract is quoted where it says the statement; the rest is known from a secondary summary
of the paper (translated here), which numbers Definition 3.5, Theorem 3.7 and
Definition 3.8.
"""
from companion.book.statements import PaperClaim, Statement, Threshold

ARXIV = "arXiv 2606.09951"
SUMMARY = "(secondary summary)"

# An exact statement (a theorem, or a property of a mask the paper derives): it holds on
# every mask, family and network drawn, or one counter-example refutes it.
EXACT = Threshold(
    kind="holds", value="qualitative", by="paper",
    reason="an exact statement of the paper (a theorem, or a property of a mask it "
           "derives): one counter-example among the masks, families or networks drawn "
           "refutes it")
# A count of counter-examples, which an exact statement puts at zero.
NO_COUNTER_EXAMPLE = Threshold(
    kind="at_most", value=0, by="paper",
    reason="the statement is exact, so the number of entries that contradict it is 0: "
           "one mismatch in any draw refutes it")
DRAWS = ("random networks (weights and inputs) and random masks: the range of the "
         "per-draw counts over the draws (5 draws at ci scale, 1 at smoke scale)")

CLAIMS: list[PaperClaim] = [
    PaperClaim(
        id="hasse-limit-converges",
        quote="As L → ∞, the reachability matrix R⁽ᴸ⁾ = Aᴸ converges to a unique limit R.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, methodology 1 (convergence)",
        threshold=EXACT,
        falsifier="layers without the residual connection (A = M instead of M ∨ I): on "
                  "random masks the Boolean powers cycle or settle on a limit that is not "
                  "the reflexive transitive closure"),
    PaperClaim(
        id="hasse-preorder-hasse",
        quote="Because of the residual connections the limit R is reflexive; with the "
              "transitivity of reachability it is a preorder, and the quotient by mutually "
              "reachable positions is a partial order, drawn as its Hasse diagram "
              "(edges: covering relations).",
        source="secondary summary",
        place=f"{ARXIV}, {SUMMARY}, methodology 1 (from total to partial order)",
        threshold=EXACT,
        falsifier="layers without the residual connection (A = M): the limit, where the "
                  "powers have one, is not reflexive, so it is no preorder"),
    PaperClaim(
        id="hasse-jacobian-equals-reachability",
        quote="A single transformer layer is a bipartite directed graph from input to "
              "output positions, given by the attention mask and the residual connection; "
              "after L layers the reachability is the Boolean power R⁽ᴸ⁾ = Aᴸ.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, methodology 1 (modelling)",
        threshold=NO_COUNTER_EXAMPLE,
        falsifier="the layer graph without the residual connection's edges (A = M) as the "
                  "prediction: every mask without its diagonal then mismatches the network",
        resamples=DRAWS, level=0.67),
    PaperClaim(
        id="hasse-causal-is-minimal-merge",
        quote="The framework reconstructs the standard causal attention mask and proves "
              "that it is the minimal merged task of the autoregressive task family.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, results (causal attention)",
        threshold=EXACT,
        falsifier="an autoregressive family whose task diagrams are not chains (each "
                  "task's context one class of mutually attending positions): its merge "
                  "shares no node and is not the causal mask"),
    PaperClaim(
        id="hasse-block-two-stream-context",
        quote="The derived mask places the mask tokens at the end of the input sequence, "
              "so that one forward pass predicts the tokens of the next block while the "
              "causal constraint between blocks is kept; the mask tokens are grouped by "
              "block with full connectivity inside the block.",
        source="secondary summary",
        place=f"{ARXIV}, {SUMMARY}, results and contributions (block two-stream attention)",
        threshold=EXACT,
        falsifier="a block generation family whose content is one class per task instead "
                  "of block-causal: its merge shares no content and is not the block "
                  "two-stream mask"),
    PaperClaim(
        id="hasse-butterfly-full-context",
        quote="The derived mask gives every position bidirectional context: replacing the "
              "target token by an aggregated representation of its neighbours, the model "
              "predicts it from the full bidirectional context without self-attention "
              "leakage.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, results (butterfly attention)",
        threshold=EXACT,
        falsifier="a bidirectional family whose context is one class per task instead of a "
                  "forward and a backward chain: its merge shares no chain and is not the "
                  "butterfly"),
    PaperClaim(
        id="hasse-merge-common-supergraph",
        quote="Taking the union of all vertex sets, partitioning it into equivalence "
              "classes and choosing a representative per class forms a new Hasse diagram, "
              "the minimal merged task, which represents the minimal common supergraph.",
        source="secondary summary", place=f"{ARXIV}, Theorem 3.7 {SUMMARY}",
        threshold=EXACT,
        falsifier="a merge that drops one covering edge: a task whose diagram uses that "
                  "edge no longer embeds"),
    PaperClaim(
        id="hasse-merge-minimal",
        quote="Two nodes of different Hasse diagrams are equivalent when their upstream "
              "dependency structures are isomorphic and their input multisets are equal; "
              "the minimal merged task keeps one representative per equivalence class.",
        source="secondary summary",
        place=f"{ARXIV}, Definition 3.5 and Theorem 3.7 {SUMMARY}",
        threshold=EXACT,
        falsifier="the disjoint union of the tasks (nothing identified): a common "
                  "supergraph with more nodes than classes and equivalent nodes in it"),
    PaperClaim(
        id="hasse-sparse-merge-same-limit",
        quote="The framework allows a sparse minimal merged task that shares the same "
              "Hasse diagram structure while it converges over several layers.",
        source="secondary summary", place=f"{ARXIV}, Definition 3.8 {SUMMARY}",
        threshold=NO_COUNTER_EXAMPLE,
        falsifier="the sparse merge with one covering edge dropped: a network of any depth "
                  "then misses dependencies the dense merged task has",
        resamples="random networks and inputs: the range of the per-draw mismatch counts "
                  "over the draws (5 at ci scale, 1 at smoke scale)", level=0.67),
    PaperClaim(
        id="hasse-butterfly-density",
        quote="Butterfly attention is a fully supervised bidirectional attention mask in "
              "which every position reaches 100% supervision density without referring to "
              "its own token.",
        source="secondary summary",
        place=f"{ARXIV}, abstract ('a fully supervised bidirectional attention mask') and "
              f"{SUMMARY}, contributions",
        threshold=Threshold(
            kind="at_least", value=1.0, by="paper",
            reason="'100% supervision density' for every position: the fraction of "
                   "positions that are prediction targets is 1"),
        falsifier="the butterfly mask with its chain positions supervised too (next-token "
                  "tasks on the forward chain, previous-token tasks on the backward chain "
                  "added to the family) reads 1; the butterfly as derived from the "
                  "bidirectional family supervises its n prediction positions only, and "
                  "reads differs",
        resamples="sequence lengths: the range of the fraction over the lengths of the "
                  "chapter's butterfly tasks (an exact count for each length)", level=1.0),
    PaperClaim(
        id="hasse-derived-no-leakage",
        quote="The derived masks let the model predict a token without self-attention "
              "leakage.",
        source="secondary summary",
        place=f"{ARXIV}, {SUMMARY}, results (block two-stream and butterfly attention)",
        threshold=NO_COUNTER_EXAMPLE,
        falsifier="block two-stream attention whose mask tokens also read their own "
                  "block's content: the mask tokens of every block but the last (whose "
                  "content the minimal layout drops) then reach their targets",
        resamples="nothing random: an exact count of positions for each derived task, no "
                  "interval", level=1.0),
    PaperClaim(
        id="hasse-butterfly-zero-gradient",
        quote="Every position predicts its token without referring to it: its input is "
              "an aggregated representation of the surrounding tokens.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, contributions (butterfly)",
        threshold=EXACT,
        falsifier="a bidirectional mask with an empty diagonal in which every position "
                  "carries and predicts its own token: through the residual connection "
                  "every prediction depends on its own token"),
    PaperClaim(
        id="hasse-train-equals-inference",
        quote="a block-generation attention mask that ensures training–inference "
              "consistency (Block Two-Stream Attention); the secondary summary adds: "
              "without approximation",
        source="abstract",
        place=f"{ARXIV}, abstract; {SUMMARY}, contributions",
        threshold=Threshold(
            kind="at_most", value=1e-12, by="ours",
            reason="'without approximation' means equal; outputs of order 1 through a few "
                   "float64 layers round to about 1e-15, so 1e-12 (about 4500 machine "
                   "epsilons) bounds rounding with room, while an approximation would be "
                   "of the outputs' order"),
        falsifier="block two-stream attention whose mask tokens also read their own "
                  "block's content, which inference has not generated yet: one-pass "
                  "training and block-by-block inference then differ by order 1",
        resamples="random networks and inputs: the range of the per-draw largest "
                  "differences (5 draws at ci scale, 1 at smoke scale)", level=0.67),
]

STATEMENTS: list[Statement] = [
    Statement(
        id="hasse-s-abstract-converges",
        quote="We prove that, with sufficient depth, the information flow of a multi-layer "
              "Transformer converges to a Hasse diagram—a directed acyclic graph "
              "representing a partial order.",
        source="abstract", place=f"{ARXIV}, abstract",
        claims=("hasse-limit-converges", "hasse-preorder-hasse",
                "hasse-jacobian-equals-reachability")),
    Statement(
        id="hasse-s-layer-graph",
        quote="A single transformer layer is modelled as a bipartite directed graph of the "
              "information flow from input to output positions, determined by the "
              "attention mask and the residual connection.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, methodology 1 (modelling)",
        claims=("hasse-jacobian-equals-reachability",)),
    Statement(
        id="hasse-s-boolean-power",
        quote="For L layers the reachability matrix is the Boolean power R⁽ᴸ⁾ = Aᴸ of the "
              "layer adjacency matrix A.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, methodology 1 (convergence)",
        claims=("hasse-jacobian-equals-reachability",)),
    Statement(
        id="hasse-s-unique-limit",
        quote="As L → ∞, R⁽ᴸ⁾ converges to a unique limit R.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, methodology 1 (convergence)",
        claims=("hasse-limit-converges",)),
    Statement(
        id="hasse-s-preorder",
        quote="Because of the residual connections R is reflexive; with transitivity the "
              "relation R defines is a preorder.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, methodology 1",
        claims=("hasse-preorder-hasse",)),
    Statement(
        id="hasse-s-partial-order",
        quote="Identifying mutually reachable positions and forming the quotient induces a "
              "partial order on the classes; its Hasse diagram has the classes as nodes and "
              "the covering relations as edges.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, methodology 1",
        claims=("hasse-preorder-hasse",)),
    Statement(
        id="hasse-s-dense-task",
        quote="A training task is a triple (input sequence, label map, attention mask); "
              "dense tasks are those whose mask adjacency equals the limit reachability.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, methodology 2",
        not_comparable="a definition, with nothing to measure; the chapter uses it (the "
                       "dense merged masks are tested with hasse-merge-minimal)"),
    Statement(
        id="hasse-s-node-equivalence",
        quote="Two nodes of different Hasse diagrams are equivalent when their upstream "
              "dependency structures are isomorphic and their input multisets are equal.",
        source="secondary summary", place=f"{ARXIV}, Definition 3.5 {SUMMARY}",
        claims=("hasse-merge-minimal",)),
    Statement(
        id="hasse-s-minimal-merge",
        quote="The union of all vertex sets, partitioned into equivalence classes with one "
              "representative per class, forms a new Hasse diagram: the minimal common "
              "supergraph.",
        source="secondary summary", place=f"{ARXIV}, Theorem 3.7 {SUMMARY}",
        claims=("hasse-merge-common-supergraph", "hasse-merge-minimal")),
    Statement(
        id="hasse-s-abstract-criterion",
        quote="We recast the design of parallel training tasks as the problem of finding a "
              "minimal common supergraph of Hasse diagrams, and we establish a criterion "
              "for the minimal common supergraph. This yields a constructive method to "
              "derive attention masks directly from a family of tasks.",
        source="abstract", place=f"{ARXIV}, abstract",
        claims=("hasse-merge-common-supergraph", "hasse-merge-minimal",
                "hasse-causal-is-minimal-merge")),
    Statement(
        id="hasse-s-sparse-merge",
        quote="Sparse minimal merged tasks share the same Hasse diagram structure and "
              "converge over several layers.",
        source="secondary summary", place=f"{ARXIV}, Definition 3.8 {SUMMARY}",
        claims=("hasse-sparse-merge-same-limit",)),
    Statement(
        id="hasse-s-causal",
        quote="The standard causal attention mask is the minimal merged task of the "
              "autoregressive task family.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, results (causal attention)",
        claims=("hasse-causal-is-minimal-merge",)),
    Statement(
        id="hasse-s-block-two-stream",
        quote="Mask tokens at the end of the sequence, grouped by block with full "
              "connectivity inside the block, predict the next block in one forward pass "
              "while the causal constraint between blocks is kept.",
        source="secondary summary",
        place=f"{ARXIV}, {SUMMARY}, results and contributions (block two-stream)",
        claims=("hasse-block-two-stream-context", "hasse-derived-no-leakage")),
    Statement(
        id="hasse-s-training-inference",
        quote="a block-generation attention mask that ensures training–inference "
              "consistency (Block Two-Stream Attention)",
        source="abstract", place=f"{ARXIV}, abstract",
        claims=("hasse-train-equals-inference",)),
    Statement(
        id="hasse-s-butterfly-context",
        quote="Replacing the target token by an aggregated representation of its "
              "neighbours, the model predicts it from the full bidirectional context "
              "without self-attention leakage.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, results (butterfly)",
        claims=("hasse-butterfly-full-context", "hasse-butterfly-zero-gradient",
                "hasse-derived-no-leakage")),
    Statement(
        id="hasse-s-butterfly-supervision",
        quote="a fully supervised bidirectional attention mask (Butterfly Attention); every "
              "position reaches 100% supervision density",
        source="abstract",
        place=f"{ARXIV}, abstract; {SUMMARY}, contributions",
        claims=("hasse-butterfly-density",)),
    Statement(
        id="hasse-s-pipeline",
        quote="A standardised derivation: define the task family → derive each task's Hasse "
              "diagram → compute node equivalence → construct the minimal merged task → "
              "read off the mask matrix.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, contributions 4",
        claims=("hasse-causal-is-minimal-merge", "hasse-block-two-stream-context",
                "hasse-butterfly-full-context")),
    Statement(
        id="hasse-s-flexattention",
        quote="Operators such as FlexAttention already support arbitrary attention masks.",
        source="abstract", place=f"{ARXIV}, abstract",
        not_comparable="a statement about another work; the chapter runs its masks, the "
                       "derived ones included, through FlexAttention as a check of ours "
                       "(hasse-flex-equals-sdpa)"),
    Statement(
        id="hasse-s-new-structures",
        quote="These results demonstrate the framework's capacity to discover new "
              "structures.",
        source="abstract", place=f"{ARXIV}, abstract",
        not_comparable="a judgement of novelty against the literature, with no computable "
                       "consequence"),
    Statement(
        id="hasse-s-future-work",
        quote="The framework mainly treats the merging of dense tasks, the sparse variant "
              "being a refinement; extending it to linear attention (KDA, GDN) and to new "
              "task families such as masked autoencoders is future work.",
        source="secondary summary", place=f"{ARXIV}, {SUMMARY}, significance",
        not_comparable="a scope and future work, with nothing the paper asserts to compute"),
]
