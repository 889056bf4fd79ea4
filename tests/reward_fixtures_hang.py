"""A reward module that never finishes importing (a blocked network call, a lock): for the start-up limit test."""
import time

while True:
    time.sleep(1.0)


def f(completion, example):  # never reached
    return 0.0
