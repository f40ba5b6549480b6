"""The checkable statements of the context_similarity chapter's paper, and its paper claims.

Halevi, Tzach, Gross, Rosner, Kanter, *Self-attention vector output similarities reveal how
machines pay attention*, arXiv 2512.21956 (Physica A 686, 2026). Only the abstract can be
read here; every number (33 %, 20,000 samples, 128 tokens, layer 11 head 8) and the layer
by layer description are known only from a secondary summary of the paper, translated
here. See :mod:`companion.book.statements` for what a :class:`Statement` and a
:class:`PaperClaim` hold. The chapter records each claim by id; the tests in
`tests/test_falsifiers_context_similarity.py` apply each claim's falsifier. Every
measurement is a function of :mod:`companion.context_similarity.measures`.
"""
from companion.book.statements import PaperClaim, Statement, Threshold

ARXIV = "arXiv 2512.21956"
ABSTRACT = f"{ARXIV}, abstract"
SUMMARY = f"{ARXIV} (secondary summary)"
WINDOWS = ("text: a bootstrap over the documents the run's 128-token windows come from, "
           "each drawn with all of its windows (a window of the Wikipedia stream by its "
           "first article); percentile interval, 1,000 replicates at ci and paper scale, "
           "200 at smoke scale")
BEFORE = "fixed before any run of this measurement"


def _ours(kind, value, reason, set_after_result=""):
    return Threshold(kind=kind, value=value, by="ours", reason=reason,
                     set_after_result=set_after_result)


def _paper_direction(reason):
    return Threshold(kind="at_least", value=0.0, by="paper", reason=reason)


CLAIMS: list[PaperClaim] = [
    PaperClaim(
        id="context-similarity-early-uniform",
        quote="Early layers: a relatively even distribution over the whole matrix, with "
              "fairly long-range context similarity; early layers show random significance "
              "across the token range.",
        source="secondary summary", place=f"{SUMMARY}, results: layer evolution, distances",
        threshold=_ours("at_most", 0.1,
                        "'fairly uniform' read as: the early layers' high-similarity pairs "
                        "differ from uniformly drawn pairs of the same windows by at most a "
                        "tenth of the pairs (total variation between the two distance "
                        f"distributions, log2 distance bins); {BEFORE}, the mean-distance "
                        "ratio with a ±25 % band that it replaces having read 'reproduced' "
                        "for pairs 24 % closer than uniform ones"),
        falsifier="the early layers' head outputs replaced by the middle layers' "
                  "(short-range) head outputs",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-early-long-range",
        quote="The initial attention layers exhibit substantially long-range similarities; "
              "however, as the layers progress, a more short-range similarity develops.",
        source="abstract", place=ABSTRACT,
        threshold=_paper_direction("the paper's comparison (early layers longer-range than "
                                   "the layers after them), with no margin added"),
        falsifier="the early and the middle layers' head outputs swapped",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-middle-short-range",
        quote="Middle layers: a strong tendency to short-range correlations, with "
              "high-similarity elements concentrated along the diagonal.",
        source="secondary summary", place=f"{SUMMARY}, results: layer evolution",
        threshold=_paper_direction("the paper's comparison (middle layers shorter-range "
                                   "than early ones), with no margin added"),
        falsifier="the early and the middle layers' head outputs swapped",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-middle-short-range-dominance",
        quote="Middle and final layers are dominated by short-range correlations.",
        source="secondary summary", place=f"{SUMMARY}, results: distance distribution",
        threshold=_ours("at_least", 0.5,
                        "'dominated' read as at least half of the high-similarity pairs, "
                        "'short range' as at most 8 tokens apart (well inside a sentence "
                        "of 20-25 wordpieces)"),
        falsifier="head outputs permuted over the positions of each window (uniform pairs "
                  "give about 12 % at most 8 tokens apart)",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-final-short-range-dominance",
        quote="Middle and final layers are dominated by short-range correlations.",
        source="secondary summary", place=f"{SUMMARY}, results: distance distribution",
        threshold=_ours("at_least", 0.5,
                        "'dominated' read as at least half of the high-similarity pairs, "
                        "'short range' as at most 8 tokens apart (well inside a sentence "
                        "of 20-25 wordpieces)"),
        falsifier="head outputs permuted over the positions of each window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-same-sentence-fraction",
        quote="Heads show a clear preference for creating strong context similarity within "
              "the same sentence (more than 33 %).",
        source="secondary summary", place=f"{SUMMARY}, results: sentence boundaries",
        threshold=Threshold(kind="at_least", value=0.33, by="paper",
                            reason="the paper's 'more than 33 %' (secondary summary, "
                                   "sentence boundaries)"),
        falsifier="head outputs permuted over the positions of each window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-same-sentence-above-chance",
        quote="This indicates that the learning process, not statistical chance, induces "
              "this syntactic grouping.",
        source="secondary summary", place=f"{SUMMARY}, results: sentence boundaries",
        threshold=_ours("at_least", 0.05,
                        "'a clear preference, not statistical chance' read as at least 5 "
                        "percentage points more same-sentence pairs than pairs drawn "
                        "uniformly from the same windows give",
                        set_after_result="set in the issue-34 revision of the chapter, with "
                        "the smoke value of the former check (smallest per-layer margin "
                        "0.080 over uniform chance, threshold 0) known"),
        falsifier="head outputs permuted over the positions of each window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-final-sentence-beyond-locality",
        quote="Final layers: context similarity extends over the tokens of the same "
              "sentence, while it drops sharply outside the sentence boundary.",
        source="secondary summary", place=f"{SUMMARY}, results: layer evolution",
        threshold=_ours("at_least", 0.05,
                        "'drops sharply' read as at least 5 percentage points more "
                        "same-sentence pairs than pairs at the same token distances give "
                        "(locality alone gives 0)",
                        set_after_result="raised from 0 in the issue-34 revision of the "
                        "chapter (0 could not be falsified: locality alone gives 0), with "
                        "the smoke value 0.028 [0.009, 0.051] known"),
        falsifier="the final layers' head outputs permuted over the positions of each "
                  "window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-final-strongest-sentence",
        quote="... culminating in a preference for attention heads to create strong "
              "similarities within the same sentence.",
        source="abstract", place=ABSTRACT,
        threshold=_paper_direction("the paper's comparison (the final layers' same-sentence "
                                   "preference above the earlier layers'), no margin added"),
        falsifier="the final layers' head outputs permuted over the positions of each "
                  "window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-final-attend-separators",
        quote="In the final layers, the attention map focuses on sentence separator tokens.",
        source="abstract", place=ABSTRACT,
        threshold=_ours("at_least", 2.0,
                        "'focuses on' read as at least twice the attention mass that "
                        "uniform attention over the window puts on '.' and ','"),
        falsifier="attention maps replaced by uniform attention over each window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-repeated-token-heads",
        quote="Different attention heads ... focused on different linguistic "
              "characteristics, such as identifying token repetitions in a given text.",
        source="abstract", place=ABSTRACT,
        threshold=_ours("at_least", 0.5,
                        "a head 'identifying token repetitions' read as one whose "
                        "high-similarity pairs mostly (at least half) join two identical "
                        f"tokens; measured on the strongest head; {BEFORE}"),
        falsifier="the token ids of each window shuffled over its positions (the head "
                  "outputs unchanged)",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-heads-specialise",
        quote="Individual heads tend to specialise in their own 'most common token' for a "
              "given input, forming similarity pairs around that token.",
        source="secondary summary", place=f"{SUMMARY}, results: unique token concentration",
        threshold=_ours("at_least", 0.5,
                        "'heads tend to' read as a majority of the heads; a head pairs "
                        "around its token of the input when that token takes at least "
                        "twice the endpoints that the commonest token of uniformly drawn "
                        f"pairs of the same window takes; {BEFORE}"),
        falsifier="head outputs permuted over the positions of each window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-heads-distinct-tokens",
        quote="This specialisation is not uniform across heads: each head converges to a "
              "different token.",
        source="secondary summary", place=f"{SUMMARY}, results: unique token concentration",
        threshold=_ours("at_least", 0.5,
                        "'each head a different token' read as at least half as many "
                        "distinct tokens as heads among one layer's per-input tokens "
                        "(1 / 12 when every head shares one)"),
        falsifier="every head of a layer given the outputs of the layer's first head",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-heads-distinct-features",
        quote="Different attention heads within an attention block focused on different "
              "linguistic characteristics.",
        source="abstract", place=ABSTRACT,
        threshold=_ours("at_least", 0.5,
                        "read as: at least half of the layers hold both a repetition head "
                        "(identical-token pairs at least 5 times chance) and a context head "
                        "(its per-input token's pairs within 8 tokens at least twice as "
                        f"often as uniform pairs); {BEFORE}"),
        falsifier="every head of a layer given the outputs of the layer's first head",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-token-with-context",
        quote="... or recognizing a token of common appearance in the text and its "
              "surrounding context.",
        source="abstract", place=ABSTRACT,
        threshold=_ours("at_least", 2.0,
                        "'its surrounding context' read as: the pairs that touch a head's "
                        "per-input token lie within 8 tokens at least twice as often as "
                        f"uniformly drawn pairs do; {BEFORE}"),
        falsifier="head outputs permuted over the positions of each window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-intra-sentence-over-long-range",
        quote="Transformers excel at mid-range correlations within a sentence but struggle "
              "with long-range context relations across a larger text.",
        source="secondary summary", place=f"{SUMMARY}, significance 4",
        threshold=_ours("at_least", 2.0,
                        "'excel ... but struggle' read as: over uniform pairs, same-sentence "
                        "pairs 9-32 tokens apart are enriched at least twice as much as "
                        f"pairs more than 32 tokens apart; {BEFORE}"),
        falsifier="head outputs permuted over the positions of each window",
        resamples=WINDOWS),
    PaperClaim(
        id="context-similarity-identical-across-window",
        quote="Certain heads (e.g. layer 11's head 8) can still recognise the identical "
              "token across the whole text.",
        source="secondary summary", place=f"{SUMMARY}, results: distance distribution",
        threshold=_ours("at_least", 2.0,
                        "'recognise the identical token across the whole text' read as: "
                        "the head's high-similarity pairs of identical tokens more than 32 "
                        "tokens apart are at least twice what uniformly drawn pairs give; "
                        "layer 11, head 8 numbered from 1 (a 12-layer, 12-head model "
                        f"only); {BEFORE}"),
        falsifier="the token ids of each window shuffled over its positions (the head "
                  "outputs unchanged)",
        resamples=WINDOWS),
]

_NOT_OPERATIONAL = ("the abstract and the secondary summary give no quantity or test for "
                    "it; ")

STATEMENTS: list[Statement] = [
    Statement(id="context-similarity-s-separators", source="abstract", place=ABSTRACT,
              quote="In the final layers, the attention map focuses on sentence separator "
                    "tokens.",
              claims=("context-similarity-final-attend-separators",)),
    Statement(id="context-similarity-s-segmentation", source="abstract", place=ABSTRACT,
              quote="... suggesting a practical approach to text segmentation based on "
                    "semantic features.",
              not_comparable="a suggestion, not a result: the paper reports no segmentation "
                             "score; the chapter's 'Beyond the paper' section tests a "
                             "segmenter of its own as our checks"),
    Statement(id="context-similarity-s-distinct-similarities", source="abstract",
              place=ABSTRACT,
              quote="A context similarity matrix ... revealing distinct similarities between "
                    "different token vector pairs within each head and layer.",
              not_comparable=_NOT_OPERATIONAL + "any matrix that is not constant shows "
                             "'distinct similarities'; the chapter shows the matrices"),
    Statement(id="context-similarity-s-heads-distinct-features", source="abstract",
              place=ABSTRACT,
              quote="Different attention heads within an attention block focused on "
                    "different linguistic characteristics.",
              claims=("context-similarity-heads-distinct-features",)),
    Statement(id="context-similarity-s-repetitions", source="abstract", place=ABSTRACT,
              quote="... such as identifying token repetitions in a given text.",
              claims=("context-similarity-repeated-token-heads",)),
    Statement(id="context-similarity-s-token-context", source="abstract", place=ABSTRACT,
              quote="... or recognizing a token of common appearance in the text and its "
                    "surrounding context.",
              claims=("context-similarity-token-with-context",)),
    Statement(id="context-similarity-s-long-to-short", source="abstract", place=ABSTRACT,
              quote="The initial attention layers exhibit substantially long-range "
                    "similarities; however, as the layers progress, a more short-range "
                    "similarity develops.",
              claims=("context-similarity-early-long-range",
                      "context-similarity-middle-short-range")),
    Statement(id="context-similarity-s-same-sentence-culmination", source="abstract",
              place=ABSTRACT,
              quote="... culminating in a preference for attention heads to create strong "
                    "similarities within the same sentence.",
              claims=("context-similarity-final-strongest-sentence",)),
    Statement(id="context-similarity-s-early-uniform", source="secondary summary",
              place=f"{SUMMARY}, results: layer evolution, distances",
              quote="Early layers: a relatively even distribution over the whole matrix, "
                    "fairly long-range context similarity, random significance across the "
                    "token range.",
              claims=("context-similarity-early-uniform",)),
    Statement(id="context-similarity-s-middle-diagonal", source="secondary summary",
              place=f"{SUMMARY}, results: layer evolution",
              quote="Middle layers: short-range correlations, high-similarity elements "
                    "concentrated along the diagonal.",
              claims=("context-similarity-middle-short-range-dominance",)),
    Statement(id="context-similarity-s-final-sentence", source="secondary summary",
              place=f"{SUMMARY}, results: layer evolution",
              quote="Final layers: context similarity extends over the tokens of the same "
                    "sentence and drops sharply outside the sentence boundary.",
              claims=("context-similarity-final-sentence-beyond-locality",)),
    Statement(id="context-similarity-s-short-range-dominance", source="secondary summary",
              place=f"{SUMMARY}, results: distance distribution",
              quote="Middle and final layers are dominated by short-range correlations.",
              claims=("context-similarity-final-short-range-dominance",)),
    Statement(id="context-similarity-s-l11h8", source="secondary summary",
              place=f"{SUMMARY}, results: distance distribution",
              quote="Certain heads (e.g. layer 11's head 8) can still recognise the "
                    "identical token across the whole text.",
              claims=("context-similarity-identical-across-window",)),
    Statement(id="context-similarity-s-most-common-token", source="secondary summary",
              place=f"{SUMMARY}, results: unique token concentration",
              quote="Individual heads tend to specialise in their own 'most common token' "
                    "for a given input, forming similarity pairs around that token.",
              claims=("context-similarity-heads-specialise",)),
    Statement(id="context-similarity-s-different-tokens", source="secondary summary",
              place=f"{SUMMARY}, results: unique token concentration",
              quote="This specialisation is not uniform across heads; each head converges "
                    "to a different token.",
              claims=("context-similarity-heads-distinct-tokens",)),
    Statement(id="context-similarity-s-33-percent", source="secondary summary",
              place=f"{SUMMARY}, results: sentence boundaries",
              quote="Heads show a clear preference for strong context similarity within the "
                    "same sentence (more than 33 %).",
              claims=("context-similarity-same-sentence-fraction",)),
    Statement(id="context-similarity-s-not-chance", source="secondary summary",
              place=f"{SUMMARY}, results: sentence boundaries",
              quote="The learning process, not statistical chance, induces this syntactic "
                    "grouping.",
              claims=("context-similarity-same-sentence-above-chance",)),
    Statement(id="context-similarity-s-lexical-to-syntactic", source="secondary summary",
              place=f"{SUMMARY}, significance 1",
              quote="Vectors evolve from lexical representations to syntactically "
                    "meaningful regions.",
              not_comparable=_NOT_OPERATIONAL + "'lexical representation' and "
                             "'syntactically meaningful region' are not defined; the "
                             "chapter's per-layer table shows the identical-token (lexical) "
                             "and same-sentence statistics side by side, with no verdict"),
    Statement(id="context-similarity-s-beyond-attention-maps", source="secondary summary",
              place=f"{SUMMARY}, significance 2",
              quote="Output vectors hold important information on signal propagation and "
                    "learning dynamics that attention weights alone cannot capture.",
              not_comparable=_NOT_OPERATIONAL + "'information that attention weights "
                             "cannot capture' is not a measured quantity; the chapter's "
                             "check on high-similarity pairs outside the high-attention "
                             "regions is ours"),
    Statement(id="context-similarity-s-noise-pairs", source="secondary summary",
              place=f"{SUMMARY}, significance 3",
              quote="Noise elements (high context similarity) occur without direct "
                    "linguistic understanding.",
              not_comparable=_NOT_OPERATIONAL + "which pairs lack 'linguistic meaning' is "
                             "not defined, and a top percentile of pairs holds some pairs "
                             "of every kind by construction; the chapter shows, as our "
                             "check, the share of high pairs with none of the relations it "
                             "measures"),
    Statement(id="context-similarity-s-pruning", source="secondary summary",
              place=f"{SUMMARY}, significance 3",
              quote="Understanding the signal-to-noise ratio in the vector space may lead to "
                    "more efficient pruning and memory use.",
              not_comparable="a proposal for future work, with no result to compare"),
    Statement(id="context-similarity-s-mid-versus-long", source="secondary summary",
              place=f"{SUMMARY}, significance 4",
              quote="Transformers excel at mid-range correlations within a sentence but "
                    "struggle with long-range context relations across a larger text.",
              claims=("context-similarity-intra-sentence-over-long-range",)),
    Statement(id="context-similarity-s-long-range-architectures", source="secondary summary",
              place=f"{SUMMARY}, significance 4",
              quote="Future progress will need architectures with direct long-range "
                    "interactions, like biological learning systems.",
              not_comparable="a proposal for future architectures, with no result to "
                             "compare"),
]
