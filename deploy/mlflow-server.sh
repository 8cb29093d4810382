#!/usr/bin/env bash
# The head's MLflow server (cluster.yaml, head_start_ray_commands). Every driver of the cluster logs
# to it: it binds the head's PRIVATE address (reached by the cluster's nodes only; see
# docs/cluster.md, "Security"), keeps runs in Postgres and serves artifacts from S3, so that both
# outlive `ray down`.
#
# The Postgres URI holds a password, so it is in no file of the repository (cluster.yaml is synced
# to every node). It is read, in this order, from
#   1. $MLFLOW_BACKEND_STORE_URI, when the head's environment has it, or
#   2. AWS Secrets Manager: the secret named $RAYFED_MLFLOW_SECRET (a plain-text secret holding
#      postgresql://USER:PASSWORD@HOST:5432/mlflow), read with the head's instance profile
#      (deploy/iam/head-policy.json grants secretsmanager:GetSecretValue on it) in the head's region.
# It reaches `mlflow server` through its environment (MLFLOW_BACKEND_STORE_URI), never its command
# line, so `ps` on the head does not show it.
#   MLFLOW_ARTIFACTS_DESTINATION  s3://BUCKET/PREFIX (required)
#   MLFLOW_PORT                   default 5000
set -euo pipefail

: "${MLFLOW_ARTIFACTS_DESTINATION:?set MLFLOW_ARTIFACTS_DESTINATION to s3://BUCKET/PREFIX (cluster.yaml)}"
VENV=${RAYFED_VENV:-$HOME/venv}

if [ -z "${MLFLOW_BACKEND_STORE_URI:-}" ]; then
  : "${RAYFED_MLFLOW_SECRET:?neither MLFLOW_BACKEND_STORE_URI nor RAYFED_MLFLOW_SECRET (a Secrets Manager secret name) is set}"
  if [ -z "${AWS_REGION:-}" ]; then  # the instance's own region, from the metadata service (IMDSv2)
    token=$(curl -sf -X PUT http://169.254.169.254/latest/api/token -H "X-aws-ec2-metadata-token-ttl-seconds: 60")
    AWS_REGION=$(curl -sf -H "X-aws-ec2-metadata-token: $token" http://169.254.169.254/latest/meta-data/placement/region)
  fi
  MLFLOW_BACKEND_STORE_URI=$("$VENV/bin/python" - "$RAYFED_MLFLOW_SECRET" "$AWS_REGION" <<'PY'
import sys

import boto3

secret = boto3.client("secretsmanager", region_name=sys.argv[2]).get_secret_value(SecretId=sys.argv[1])
print(secret["SecretString"].strip())
PY
)
fi
export MLFLOW_BACKEND_STORE_URI

host=$(hostname -I | cut -d' ' -f1)  # the head's private address
# --allowed-hosts default: localhost and private addresses, which is how every node reaches it
exec "$VENV/bin/mlflow" server --host "$host" --port "${MLFLOW_PORT:-5000}" --workers 2 \
  --serve-artifacts --artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION"
