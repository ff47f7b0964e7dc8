# One image for every tokenfleet service (gateway, scheduler, Ray head and workers).
# CPU build by default; on GPU hosts build FROM a CUDA PyTorch image and widen the torch pin.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    TOKENFLEET_HOME=/data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY scripts/constraints.txt scripts/constraints.txt
COPY tokenfleet tokenfleet
COPY gateway gateway
COPY scheduler scheduler
COPY workers workers
COPY shared shared
COPY protocol protocol
COPY service service
# The constraints pin torch's CPU build (an unpinned torch pulls a multi-GB CUDA build).
RUN pip install --no-cache-dir -c scripts/constraints.txt . && mkdir -p /data/models
VOLUME ["/data"]
ENTRYPOINT ["tokenfleet"]
CMD ["--help"]
