"""S3 connection and encryption options, shared by checkpoint stores and dataset staging.

The same five settings exist in the job spec (`elasticyolo submit ... s3_sse=aws:kms`) and in the
agent config (node defaults; `ELASTICYOLO_S3_*` in the environment). A job's own value wins, then
the agent's, then boto3's standard chain (`AWS_PROFILE`, `AWS_REGION`, `AWS_ENDPOINT_URL_S3`,
instance role). Agents export their values as `ELASTICYOLO_S3_*`, so workers resolve the same
way. None of these is a secret: credentials come from boto3's chain, never from here.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Mapping

from pydantic import BaseModel, Field, field_validator, model_validator

S3_FIELDS = ("s3_endpoint_url", "s3_region", "s3_profile", "s3_sse", "s3_kms_key_id")


class S3Settings(BaseModel):
    """Mixin for TrainSpec and AgentConfig (field names are the `key=value` / YAML names)."""

    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, GCS XML API, ...)")
    s3_region: str | None = None
    s3_profile: str | None = Field(None, description="AWS profile on the node (~/.aws/config)")
    s3_sse: Literal["AES256", "aws:kms", "aws:kms:dsse"] | None = Field(
        None, description="server-side encryption sent with every put (multipart uploads too)")
    s3_kms_key_id: str | None = Field(None, description="KMS key for aws:kms (implies s3_sse=aws:kms)")

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint_ok(cls, v: str | None) -> str | None:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} is not an http(s) URL")
        return v or None

    @model_validator(mode="after")
    def _sse_ok(self) -> "S3Settings":
        if self.s3_kms_key_id and self.s3_sse == "AES256":
            raise ValueError("s3_kms_key_id needs s3_sse=aws:kms (or leave s3_sse unset)")
        return self

    def s3_env(self) -> dict[str, str]:
        """These settings as `ELASTICYOLO_S3_*` variables, for child processes."""
        return {f"ELASTICYOLO_{name.upper()}": str(getattr(self, name)) for name in S3_FIELDS
                if getattr(self, name) not in (None, "")}


def s3_options(uri: str | None, spec: Any = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`open_store(uri, **options)` keywords for `uri`: the spec's values, else the environment's
    `ELASTICYOLO_S3_*`. Empty for non-S3 URIs (file:// stores take no S3 options)."""
    if not uri or not str(uri).startswith("s3://"):
        return {}
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name in S3_FIELDS:
        value = getattr(spec, name, None) if spec is not None else None
        if value in (None, ""):
            value = env.get(f"ELASTICYOLO_{name.upper()}") or None
        if value is not None:
            out[name.removeprefix("s3_")] = value
    return out
