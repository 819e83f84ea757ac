"""``prefix-gateway doctor``: the operator's answer to "why is my hit rate low?".

One module per job:

- :mod:`.model`: the shapes every other module shares (a request sample, the corpus, a finding);
- :mod:`.sources`: build a corpus from a running gateway (``/admin/stats`` + ``/admin/samples``)
  or from a JSONL file of OpenAI request bodies (replayed through the route's own pipeline);
- :mod:`.replay`: the hit rate an LRU cache of blocks would see for a sequence of key chains;
- :mod:`.spans`: find volatile spans no rule knows by diffing requests that share a template,
  and suggest a regex rule for each;
- :mod:`.analyses`: one function per cause, each returning findings with evidence and a fix;
- :mod:`.report`: rank the findings and render them as text or JSON.
"""

from __future__ import annotations

from gateway.doctor.analyses import Diagnosis, diagnose
from gateway.doctor.report import render_json, render_text, to_dict

__all__ = ["Diagnosis", "diagnose", "render_json", "render_text", "to_dict"]
