from twinplane.data.stream import PromptStream
from twinplane.data.tasks.arithmetic import ALPHABET, ArithmeticTask, Problem, teacher_answer

__all__ = ["ALPHABET", "ArithmeticTask", "Problem", "PromptStream", "teacher_answer"]
