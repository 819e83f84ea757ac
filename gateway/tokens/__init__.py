"""Text as the served model sees it: vocabularies, chat templates, alignment, the windowed segment tokenizer."""
