"""Model card templates of hf-pma, shipped in the wheel as ``hf_pma.model_cards``.

The templates are Jinja markdown files rendered by :func:`hf_pma.card.build_model_card`
through ``huggingface_hub.ModelCard.from_template``. This file only makes the folder a regular
package, so ``importlib.resources`` finds it in editable and regular installs alike.
"""
