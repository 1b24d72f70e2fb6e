// rejects: conversion function from 'float' to 'bf16' invokes a deleted function
// A float is rounded to bf16 only by the named to_bf16(), never silently.
import shardckpt;
using namespace shardckpt;

bf16 f() { return 3.0f; }
