"""The checkable statements of the gradient_flow chapter's paper, and its paper claims.

Massucco, Del Grande, Carioni, Brune, Schönlieb, *Multi-Headed Transformer Architectures
as Time-dependent Wasserstein Gradient Flows*, arXiv 2605.18870. Only the abstract is
readable here; the authors' README (MIT code) numbers Theorem 4.16, Section 6, Eq. (5) and
Eq. (81); everything else is known from a secondary summary of the paper.

See :mod:`companion.book.statements` for what a :class:`Statement` and a
:class:`PaperClaim` hold. The chapter records each claim by id; the tests in
`tests/test_falsifiers_gradient_flow.py` apply each claim's falsifier.
"""
from companion.book.statements import PaperClaim, Statement, Threshold

ARXIV = "arXiv 2605.18870"
README = "per the authors' code README"

# What every interval of this chapter resamples: the Monte Carlo paths, each an
# independent draw of what the statements range over.
PATHS = ("the Monte Carlo paths (expanded percentile bootstrap): each path has its own "
         "initial token cloud (octahedron vertices plus Gaussian noise), its own initial "
         "weights D_h(0) = Z + Zᵀ and its own weight-noise path")

_ORDER_TOL = Threshold(
    kind="abs", value=1.0, by="ours", tolerance=0.25,
    reason="a discretised identity closes at the scheme's order, 1 for projected Euler; "
           "the paper gives no number. The interval must lie closer to 1 than to 0.5 (a "
           "residual that barely shrinks) or 1.5: within 1 ± 0.25",
    set_after_result="dd8f42b: widened from the range (0.9, 1.1) of b0fd6dd after the "
                     "first runs")

_EDI_REL = Threshold(
    kind="abs", value=0.0, by="ours", tolerance=0.1,
    reason="an identity verified numerically leaves only discretisation error, and it "
           "tests its slope term only if that error is small against the term: we "
           "require the path-mean residual at t = T to be within 10 % of the path-mean "
           "∫G² (with G² set to zero the ratio is about -1)",
    set_after_result="chosen in this commit after seeing ratios of 0.05 (H = 1) and 0.75 "
                     "(H = 100) at dt = 0.01; it replaces 5 % of max|E(t) - E(0)| "
                     "(EDI_REL_TOL, dd8f42b, set with the measurement), which was larger "
                     "than ∫G² itself")

_EDI_QUOTE = ("the discrete energy-dissipation identity is verified along the simulated "
              "trajectories, confirming that the numerical scheme is consistent with the "
              "continuous theory")
_EDI_PLACE = (f"{ARXIV}, Section 6 and Eq. (81) ({README}); the sentence: (secondary "
              "summary), numerical validation")

_GRONWALL = Threshold(
    kind="at_most", value=1.0, by="ours",
    reason="the paper proves a bound of the form exp(∫L)·(initial distance) (plus a "
           "forcing term for the weights) without the constant we can read here; L is our "
           "Lipschitz constant (gf.lipschitz_constant), so the ratio W₂/bound must stay "
           "at most 1 where the bound is below the sphere's diameter 2")

CLAIMS: list[PaperClaim] = [
    PaperClaim(
        id="gradient-flow-ou-exponent",
        quote="the strong upper gradient decreases at the rate O(H⁻¹) in the number of "
              "heads H (integrable, Ornstein–Uhlenbeck weights)",
        source="authors' code",
        place=f"{ARXIV}, Theorem 4.16 and Section 6 ({README}: 'b ≈ -1 (OU)')",
        threshold=Threshold(
            kind="abs", value=-1.0, by="ours", tolerance=0.25,
            reason="the exponent -1 is the paper's (O(1/H)); the slack is ours: the "
                   "interval must lie closer to -1 than to -0.5, the 1/√H a plain Monte "
                   "Carlo average would give",
            set_after_result="dd8f42b: widened from the range (-1.2, -0.8) of b0fd6dd "
                             "after the first runs"),
        falsifier="oscillating weights with one common target F(t) in place of the "
                  "Ornstein–Uhlenbeck process (a non-integrable regime): b near 0",
        resamples=PATHS + ", at every H"),
    PaperClaim(
        id="gradient-flow-oscillating-exponent",
        quote="with undamped oscillating weights the slope does not decrease "
              "(README: 'oscillating weights give b ≈ 0, no decay')",
        source="authors' code",
        place=f"{ARXIV}, Section 6 ({README}); (secondary summary), numerical validation",
        threshold=Threshold(
            kind="abs", value=0.0, by="ours", tolerance=0.25,
            reason="'no decay' is b = 0 (the README's number); the slack is ours: closer "
                   "to 0 than to -0.5, the weakest decay we would call one",
            set_after_result="dd8f42b: widened from the range (-0.2, 0.2) of b0fd6dd "
                             "after the first runs"),
        falsifier="head h given the phase 2πh/H (the published package's spread "
                  "targets): the oscillations cancel in the head average and b falls "
                  "towards -1",
        resamples=PATHS + ", at every H"),
    PaperClaim(
        id="gradient-flow-ou-limit-stationary",
        quote="every element of the ω-limit set is a stationary point of the limiting "
              "energy associated with the weights' limit law; the token cloud relaxes to "
              "a stationary configuration consistent with the limiting weight "
              "distribution",
        source="authors' code",
        place=f"{ARXIV}, abstract and Theorem 4.16 ({README}); (secondary summary), "
              "asymptotic behaviour and numerical validation",
        threshold=Threshold(
            kind="at_most", value=0.1, by="ours",
            reason="at a stationary point the attention pull under the limit law is "
                   "normal to the sphere (tangential share 0); a uniformly random cloud "
                   "has 0.1 to 0.2 and the oscillating regime's cloud about 0.2. With H "
                   "heads the weight law is within O(H^-1/2) of its limit, 0.1 at the "
                   "paper's H = 100",
            set_after_result="chosen in this commit after a first look at the shares "
                             "(0.04 for OU at H = 100, 0.2 oscillating, ci sizes)"),
        falsifier="the final state of a run with oscillating weights (a state that is "
                  "not stationary for the limit law) in place of the OU final state; the "
                  "octahedral start is not a falsifier, it is stationary by symmetry",
        resamples=PATHS + "; each path also has its own draw of the limit law's heads"),
    PaperClaim(
        id="gradient-flow-oscillating-does-not-settle",
        quote="when undamped oscillating weights are present, the token cloud does not "
              "settle",
        source="secondary summary",
        place=f"{ARXIV}, Section 6 ({README}); (secondary summary), numerical "
              "validation, oscillating regime (snapshots at t = 16, 18, 20)",
        threshold=Threshold(
            kind="at_least", value=0.1, by="ours",
            reason="the paper judges settling on snapshots at t = 16, 18, 20 of T = 20; "
                   "we require the cloud to move by at least W₂ = 0.1 (5 % of the "
                   "sphere's diameter) over the last fifth of the run",
            set_after_result="8296eb2: SETTLE_W2 = 0.1 'set with the measurement above' "
                             "(first set in dd8f42b)"),
        falsifier="tokens held fixed over the last fifth of the run (W₂ = 0)",
        resamples=PATHS),
    PaperClaim(
        id="gradient-flow-oscillating-no-cluster",
        quote="when undamped oscillating weights are present, the token cloud does not "
              "cluster; token clustering is not a universal feature but depends on the "
              "stability of the parameter dynamics",
        source="secondary summary",
        place=f"{ARXIV}, abstract (non-integrable regime); (secondary summary), "
              "asymptotic behaviour and numerical validation",
        threshold=Threshold(
            kind="at_most", value=0.5, by="ours",
            reason="a token is in a cluster when another token is within inner product "
                   "0.999 of it (GLPR's criterion); a clustered cloud has every token in "
                   "a cluster (share 1), and we call the cloud clustered when most of "
                   "its tokens are: the share must be at most 0.5",
            set_after_result="chosen in this commit after a first look at smoke and "
                             "n = 50 runs (0.1 to 0.5 under descent, 1 under the "
                             "clustering sign)"),
        falsifier="the same oscillating weights with the opposite sign of the dynamics "
                  "(the GLPR clustering flow): every token in a cluster",
        resamples=PATHS),
    PaperClaim(
        id="gradient-flow-edi-ou-h100",
        quote=_EDI_QUOTE + " (the energy-balance figure: OU weights, H = 100)",
        source="secondary summary", place=_EDI_PLACE, threshold=_EDI_REL,
        falsifier="G² set to zero in the identity: the ratio becomes about -1",
        resamples=PATHS),
    PaperClaim(
        id="gradient-flow-edi-ou-h1",
        quote=_EDI_QUOTE + " (README: 'EDI ≈ 0 is verified in every experiment'; here "
                           "the OU run with one head)",
        source="secondary summary", place=_EDI_PLACE, threshold=_EDI_REL,
        falsifier="G² set to zero in the identity: the ratio becomes about -1",
        resamples=PATHS),
    PaperClaim(
        id="gradient-flow-edi-first-order-h1",
        quote=_EDI_QUOTE + " (one head, frozen weights: the residual must vanish as "
                           "dt → 0)",
        source="secondary summary", place=_EDI_PLACE, threshold=_ORDER_TOL,
        falsifier="G² set to zero in the identity: the residual no longer shrinks with "
                  "dt (order near 0)",
        resamples=PATHS + "; a path keeps its residuals at every dt together"),
    PaperClaim(
        id="gradient-flow-edi-first-order-multihead",
        quote=_EDI_QUOTE + " (several distinct heads, the identity written with the "
                           "harmonic-mean effective mobility)",
        source="secondary summary", place=_EDI_PLACE, threshold=_ORDER_TOL,
        falsifier="G² set to zero in the identity (order near 0); the test also shows "
                  "the measurement reads order 1 for H identical heads",
        resamples=PATHS + "; a path keeps its residuals at every dt together"),
    PaperClaim(
        id="gradient-flow-gronwall-tokens",
        quote="a Grönwall-type estimate shows continuous dependence on the initial data",
        source="abstract",
        place=f"{ARXIV}, abstract ('continuous dependence on the initial data'); "
              "(secondary summary), stability: input perturbations",
        threshold=_GRONWALL,
        falsifier="the perturbed run driven by another weight-noise path: the two "
                  "trajectories separate whatever the token perturbation",
        resamples=PATHS + "; the measured value is the largest ratio over paths"),
    PaperClaim(
        id="gradient-flow-gronwall-weights",
        quote="the gradient flow converges under perturbations of the weight "
              "initialisation strategy",
        source="secondary summary",
        place=f"{ARXIV}, abstract (Γ-convergence under weight perturbation); (secondary "
              "summary), stability: weight perturbations",
        threshold=_GRONWALL,
        falsifier="the perturbed run driven by another weight-noise path",
        resamples=PATHS + "; the measured value is the largest ratio over paths"),
]

STATEMENTS: list[Statement] = [
    Statement(
        id="gradient-flow-stmt-model",
        quote="multi-head transformer with time- and head-dependent weights θ_t^(h); "
              "tokens on S^(d-1) by layer normalisation (the simulated system)",
        source="authors' code", place=f"{ARXIV}, Eq. (5) ({README})",
        not_comparable="the model itself, not a statement about it: the chapter's engine "
                       "equals the authors' code to rounding (tests/reference_pairs) and "
                       "every claim below runs it"),
    Statement(
        id="gradient-flow-stmt-mean-field-pde",
        quote="in the mean-field limit the tokens' law μ_t solves a continuity equation "
              "(the transformer PDE) driven by a velocity averaged over the weights' law "
              "Θ_t, which itself evolves by an SDE",
        source="secondary summary", place="(secondary summary), methodology 1",
        not_comparable="a limit n → ∞ of the particle system; the chapter simulates "
                       "finite n only"),
    Statement(
        id="gradient-flow-stmt-harmonic-mobility",
        quote="the effective scalar mobility is the Θ_t-weighted harmonic mean of the "
              "individual heads' mobilities, reducing the multi-head geometry to one "
              "scalar factor on token space",
        source="secondary summary", place="(secondary summary), methodology 2",
        claims=("gradient-flow-edi-first-order-multihead", "gradient-flow-edi-ou-h100")),
    Statement(
        id="gradient-flow-stmt-wm2-equivalent",
        quote="the weighted distance Wₘ,₂ and the classical 2-Wasserstein distance are "
              "equivalent, so the space is complete and compact",
        source="secondary summary", place="(secondary summary), methodology 2",
        not_comparable="a theorem about a distance we do not compute (its dynamic form "
                       "needs a transport solver with a mobility); the check "
                       "gradient-flow-mobility-bounded shows, on the chapter's measures, "
                       "the mobility range whose bounds are the equivalence constants"),
    Statement(
        id="gradient-flow-stmt-jko",
        quote="solutions for the time-dependent interaction energy are constructed with "
              "the Jordan–Kinderlehrer–Otto minimizing-movement scheme",
        source="secondary summary", place="(secondary summary), methodology 3",
        not_comparable="a construction in a proof: the authors' numerics, and ours, "
                       "integrate the particle system by projected Euler, not by JKO steps"),
    Statement(
        id="gradient-flow-stmt-maximal-slope",
        quote="solutions of the transformer PDE are curves of maximal slope of the "
              "time-dependent energy for the weighted Wasserstein distance; an "
              "energy-dissipation identity (EDI) accounts for the explicit time "
              "dependence",
        source="secondary summary", place=f"(secondary summary), methodology 3; "
                                          f"{ARXIV}, Eq. (81) ({README})",
        claims=("gradient-flow-edi-first-order-h1",
                "gradient-flow-edi-first-order-multihead")),
    Statement(
        id="gradient-flow-stmt-pde-equals-flow",
        quote="solutions of the transformer PDE coincide with gradient flows of the "
              "interaction energy, and conversely",
        source="secondary summary", place="(secondary summary), contributions 1",
        not_comparable="an equivalence of two solution concepts; its computable "
                       "consequence is the EDI, tested under "
                       "gradient-flow-stmt-maximal-slope"),
    Statement(
        id="gradient-flow-stmt-special-cases",
        quote="the framework recovers the single-head and multi-head formulations with "
              "time-evolving parameters as special cases",
        source="secondary summary", place="(secondary summary), contributions 1",
        not_comparable="a statement about the framework's scope, not a quantity; the "
                       "check gradient-flow-identical-heads-single confirms its "
                       "computable consequence here (H identical heads move the tokens "
                       "as one head does)"),
    Statement(
        id="gradient-flow-stmt-gronwall",
        quote="a Grönwall-type estimate shows continuous dependence on the initial data "
              "(robustness to noisy inputs), and uniqueness",
        source="abstract", place=f"{ARXIV}, abstract",
        claims=("gradient-flow-gronwall-tokens",)),
    Statement(
        id="gradient-flow-stmt-gamma",
        quote="the perturbed interaction energies Γ-converge to the unperturbed energy",
        source="abstract", place=f"{ARXIV}, abstract",
        not_comparable="Γ-convergence of functionals of measures cannot be computed; on "
                       "the compact sphere any perturbation that shrinks uniformly gives "
                       "it, which the check gradient-flow-gamma-energy shows (it cannot "
                       "fail for a continuous perturbation, so it is not a paper claim)"),
    Statement(
        id="gradient-flow-stmt-weight-perturbation",
        quote="the gradient flow converges under perturbations of the weight "
              "initialisation strategy",
        source="secondary summary", place="(secondary summary), stability",
        claims=("gradient-flow-gronwall-weights",)),
    Statement(
        id="gradient-flow-stmt-omega-limit",
        quote="under integrable weight dynamics the ω-limit set is non-empty and its "
              "elements are stationary points of the limiting energy",
        source="authors' code", place=f"{ARXIV}, abstract and Theorem 4.16 ({README})",
        claims=("gradient-flow-ou-limit-stationary",)),
    Statement(
        id="gradient-flow-stmt-slope-1-over-h",
        quote="the strong upper gradient decreases at the rate O(H⁻¹) in the number of "
              "heads (OU weights)",
        source="authors' code", place=f"{ARXIV}, Theorem 4.16, Section 6 ({README})",
        claims=("gradient-flow-ou-exponent",)),
    Statement(
        id="gradient-flow-stmt-oscillating",
        quote="with undamped oscillating weights the token cloud does not cluster or "
              "settle and the slope does not decrease, confirming that the integrability "
              "assumption is sharp",
        source="secondary summary", place=f"{ARXIV}, Section 6 ({README}); (secondary "
                                          "summary), numerical validation",
        claims=("gradient-flow-oscillating-exponent",
                "gradient-flow-oscillating-does-not-settle")),
    Statement(
        id="gradient-flow-stmt-clustering-not-universal",
        quote="token clustering is not a universal feature of deep transformer dynamics "
              "but depends on the stability and integrability of the weight oscillations",
        source="secondary summary", place=f"{ARXIV}, abstract; (secondary summary), "
                                          "significance 2",
        claims=("gradient-flow-oscillating-no-cluster",)),
    Statement(
        id="gradient-flow-stmt-edi-verified",
        quote=_EDI_QUOTE,
        source="secondary summary", place=_EDI_PLACE,
        claims=("gradient-flow-edi-ou-h100", "gradient-flow-edi-ou-h1")),
    Statement(
        id="gradient-flow-stmt-weight-decay",
        quote="the stability estimates give a theoretical basis for regularisation such "
              "as weight decay and for weight initialisation strategies",
        source="secondary summary", place="(secondary summary), stability",
        not_comparable="an interpretation for training, which this paper's experiments "
                       "(and ours) do not run"),
]
