from twinplane.tasks.arithmetic import ALPHABET, ArithmeticTask, Problem, PromptStream, teacher_answer

__all__ = ["ALPHABET", "ArithmeticTask", "Problem", "PromptStream", "teacher_answer"]
