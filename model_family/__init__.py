"""The project's own model family: one target and several domain drafters sharing one tokenizer.

Everything here is reproducible from package names (see docs/model_card.md): fetch corpora, build the
tokenizer, train the target, distil the drafters, derive the cost-realistic bench target, measure acceptance.
"""

DOMAINS = ("code", "biomedical", "legal", "literature", "dialogue", "techdocs")
