"""Plumbing shared by every part of the package: crash-safe file writes (:mod:`.io`), checks
of settings fields (:mod:`.checks`) and the record of versions and hardware that every result
file carries (:mod:`.env`, its torch-free part :mod:`.versions`). Nothing here imports
transformers."""
