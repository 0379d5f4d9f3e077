"""nbgen: a Jupyter-first LLM inference toolkit with its own engine.

``import nbgen as sgl`` runs SGLang's offline-Engine notebooks: ``sgl.Engine(...).generate(...)``.
"""
from nbgen.dataframe import generate_df
from nbgen.dataframe_embed import embed_df
from nbgen.dataframe_images import show_images
from nbgen.dataframe_score import score_df
from nbgen.engine import Engine
from nbgen.core.interrupt import GenerationInterrupted
from nbgen.core.logit_processor import CustomLogitProcessor
from nbgen.notebook import chat_session, dashboard, playground, profile, stream
from nbgen.core.sampling import SamplingParams
from nbgen.core.version import __version__

__all__ = ["Engine", "SamplingParams", "CustomLogitProcessor", "generate_df", "embed_df", "show_images", "score_df", "GenerationInterrupted", "chat_session", "dashboard", "stream", "playground", "profile", "__version__"]
