"""Pictures of schedules: Gantt charts (matplotlib, imported only when one is drawn) and Chrome traces."""
from .gantt import gantt_figure, write_gantt
from .trace import chrome_trace, write_chrome_trace

__all__ = ["chrome_trace", "write_chrome_trace", "gantt_figure", "write_gantt"]
