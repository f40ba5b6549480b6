"""``torchrun --nproc-per-node N -m companion.context_similarity --corpus brown ...``."""
from companion.context_similarity.corpus import _main

raise SystemExit(_main())
