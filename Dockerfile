# prefix-gateway: one process per pod; several pods share routing state through Redis.
FROM python:3.11-slim

# DL3064 flags the word TOKENIZER in a path name; no secret is set here.
# hadolint ignore=DL3064
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFIX_GATEWAY_TOKENIZER_DIR=/opt/prefix-gateway/tiktoken

WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway

# Install (with the [epp] extra: gRPC and Envoy's ext_proc protos, so the same image runs
# `serve` and `epp`, k8s/epp.yaml), then write the tokenizer vocabularies into the image so pods
# never download them and never need a writable filesystem for them (air-gapped clusters work as is).
RUN pip install --no-cache-dir "./[epp]" \
 && python -c "from gateway.tokens.tokenizer import materialize_encoding as m; m('cl100k_base'); m('o200k_base')" \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin gateway

USER 10001
# 8000: serve; 9002 (gRPC ext_proc + health) and 9090 (metrics/admin): epp
EXPOSE 8000 9002 9090
ENTRYPOINT ["prefix-gateway"]
# Without --config: ./config/gateway.yaml if mounted at /app/config, else the packaged default
# (k8s/deployment.yaml mounts its ConfigMap and passes --config).
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
