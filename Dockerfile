# reflow's image: every process (`reflow gateway`, `worker`, `scheduler`, `feedback consume`, and
# `mlflow server` for the registry), as deploy/kubernetes/ runs them. The steps are `make install`'s:
# torch pinned first, then reflow with uv, torch named again so that nothing moves it. TORCH_INDEX
# picks the CPU build (the default) or a CUDA one, e.g.
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t reflow:cuda .
# Worker isolation is a NetworkPolicy there, not eBPF (a pod would need CAP_BPF): no clang here.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/reflow
ENV PATH=/opt/reflow/bin:$PATH
RUN pip install --no-cache-dir --disable-pip-version-check --index-url "$TORCH_INDEX" torch==2.13.0 \
 && pip install --no-cache-dir --disable-pip-version-check uv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY reflow reflow
COPY gateway gateway
COPY workers workers
COPY feedback feedback
COPY migrations migrations
RUN uv pip install --no-cache --compile-bytecode --python /opt/reflow/bin/python . torch==2.13.0

FROM python:${PYTHON}-slim
# g++: a worker compiles its CPU attention kernel for the CPU it runs on (workers/models/native.py);
# without one, bfloat16 attention runs as slower torch operators
RUN apt-get update -q && apt-get install -y -q --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --create-home --home-dir /home/reflow reflow \
 && mkdir -p /var/lib/reflow && chown reflow /var/lib/reflow
COPY --from=build /opt/reflow /opt/reflow
ENV PATH=/opt/reflow/bin:$PATH \
    REFLOW_DATA_DIR=/var/lib/reflow \
    REFLOW_ISOLATION=none
USER 10001
WORKDIR /var/lib/reflow
ENTRYPOINT ["reflow"]
CMD ["--help"]
