# One image for every tokenfleet service (gateway, scheduler, Ray head and workers).
# CPU build by default; on GPU hosts build FROM a CUDA PyTorch image and widen the torch pin.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    TOKENFLEET_HOME=/data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY scheduler scheduler
COPY workers workers
COPY shared shared
RUN pip install --no-cache-dir . && mkdir -p /data/models
VOLUME ["/data"]
ENTRYPOINT ["tokenfleet"]
CMD ["--help"]
