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

# Install (with the [epp] extra: the same image runs `epp`, the endpoint picker, on 9002/9090),
# then write the tokenizer vocabularies into the image so pods never download
# them and never need a writable filesystem for them (air-gapped clusters work as is).
# DL3013 (pin versions) reads ".[epp]" as a package name: it is this project, with its extra.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[epp]" \
 && python -c "from gateway.tokens.tokenizer import materialize_encoding as m; m('cl100k_base'); m('o200k_base')" \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin gateway

USER 10001
EXPOSE 8000 9002 9090
ENTRYPOINT ["prefix-gateway"]
# Without --config: ./config/gateway.yaml if mounted at /app/config, else the packaged default
# (k8s/deployment.yaml mounts its ConfigMap and passes --config).
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
