"""The SD3 family's sampling pipeline: diffusers' StableDiffusion3Pipeline with its layout's defaults.

SD3.5 Medium samples best with skip-layer guidance (its model card; Stability's reference
sampler), which StableDiffusion3Pipeline takes as call arguments but does not apply by itself.
This pipeline fills in the values the family chose for it (models/sd3/family.py: the layout's
`LAYOUT_SAMPLING`, or sample.skip_layer_guidance* / generate --slg) for every call that leaves
them out; a call that passes one, ``skip_guidance_layers=None`` included, keeps its own.
Imported only where a pipeline is built (diffusers pipelines take seconds to import).
"""
from __future__ import annotations

from diffusers import StableDiffusion3Pipeline


class LayoutPipeline(StableDiffusion3Pipeline):
    """StableDiffusion3Pipeline that takes `layout_defaults` (call arguments) where a call does not
    set them."""

    layout_defaults: dict = {}  # set per pipeline by the family; read-only here

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **{**self.layout_defaults, **kwargs})
