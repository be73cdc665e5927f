"""The project's own model family, and where any model comes from.

The family (one target and several domain drafters sharing one tokenizer) is reproducible from package names
(docs/model_card.md): fetch corpora, build the tokenizer, train the target, distil the drafters, derive the
cost-realistic bench target, measure acceptance. `sources` resolves a model reference (a shipped name, a
directory or a Hugging Face id) to a local directory on the node that loads it; `compat` checks that models
serve together (vocabularies, EOS).
"""

DOMAINS = ("code", "biomedical", "legal", "literature", "dialogue", "techdocs")
