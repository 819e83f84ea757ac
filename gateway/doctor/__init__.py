"""``prefix-gateway doctor``: the operator's answer to "why is my hit rate low?".

One module per job:

- :mod:`.model`: the shapes every other module shares (a request sample, the corpus, a finding);
- :mod:`.sources`: build a corpus from a running gateway (``/admin/stats`` + ``/admin/samples``)
  or from a JSONL file of OpenAI request bodies (replayed through the route's own pipeline);
- :mod:`.replay`: the hit rate an LRU cache of blocks would see for a sequence of key chains;
- :mod:`.spans`: find volatile spans no rule knows by diffing requests that share a template,
  and suggest a regex rule for each;
- :mod:`.replayed`: the causes the samples show, each fix's gain replayed on their key chains;
- :mod:`.live_stats`: the causes read from a running gateway's ``/admin/stats``;
- :mod:`.evidence`: the wording findings share (percentages, a route's YAML fix);
- :mod:`.analyses`: :func:`diagnose` runs both families over every route and ranks the findings;
- :mod:`.report`: rank the findings and render them as text or JSON.
"""

from __future__ import annotations

from gateway.doctor.analyses import Diagnosis, diagnose
from gateway.doctor.report import render_json, render_text, to_dict

__all__ = ["Diagnosis", "diagnose", "render_json", "render_text", "to_dict"]
